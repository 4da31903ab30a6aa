"""A non-editable install carries the Hydra configs: the wheel works from another folder."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RUN_FROM_WHEEL = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, {where!r})
import kspipe
assert kspipe.__file__.startswith({where!r}), kspipe.__file__
sys.argv = ["kspipe", "+experiment=omniglot_5way", "workers=0"]
from kspipe.cli.command import main
main()
"""


def test_wheel_has_configs_and_runs_outside_the_checkout(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                    str(tmp_path), str(REPO)], check=True, timeout=600)
    (wheel,) = tmp_path.glob("kspipe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kspipe/conf/config.yaml" in names
    assert "kspipe/conf/experiment/omniglot_5way.yaml" in names
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run([sys.executable, "-c", RUN_FROM_WHEEL.format(where=str(unpacked))],
                            cwd=elsewhere, capture_output=True, text=True, timeout=120)
    # The config composed from the wheel's files, so validation reached the value:
    assert "kspipe: error: workers=0 must be at least 1" in result.stderr, result.stderr
    assert result.returncode == 2
