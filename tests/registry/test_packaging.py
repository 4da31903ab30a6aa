"""A non-editable install carries the Hydra configs: the wheel works from another folder.  It
carries the public test kit (``kspipe.testing``), which imports without the checkout and
changes nothing in the process, and none of the suite's own pieces (``tests.kit``).  The
example plugins install into the suite's environment without changing any package in it."""

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from tests import kit

REPO = Path(__file__).resolve().parents[2]

#: The wheel's kspipe first on the path, and no editable install's finder.
FROM_WHEEL = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, {where!r})
"""

RUN_FROM_WHEEL = (
    FROM_WHEEL
    + """
import kspipe
assert kspipe.__file__.startswith({where!r}), kspipe.__file__
sys.argv = ["kspipe", "+experiment=omniglot_5way", "workers=0"]
from kspipe.cli.command import main
main()
"""
)

#: The public kit from the wheel, outside the checkout: every name it exports is there, and
#: importing it sets no environment variable and loads no Paddle (nor its allocator).
KIT_FROM_WHEEL = (
    FROM_WHEEL
    + """
import os
before = dict(os.environ)
import kspipe.testing
assert kspipe.testing.__file__.startswith({where!r}), kspipe.testing.__file__
for name in kspipe.testing.__all__:
    getattr(kspipe.testing, name)
assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
assert "paddle" not in sys.modules
"""
)

#: The public kit's modules, all the wheel's kspipe/testing holds.
PUBLIC_KIT = ["__init__.py", "commands.py", "runs.py", "serving.py"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """kspipe's wheel, built from the checkout's tracked files, and the folder it is
    unpacked in.  Built from a copy: setuptools leaves a ``build/`` folder where it builds,
    and a stale one would put modules the checkout no longer has into the wheel."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"
    source.mkdir()
    archive = (
        subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], check=True, capture_output=True)
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, archive):
        if (REPO / name).is_file():  # a file deleted in the working tree is not copied
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        check=True,
        timeout=600,
    )
    (wheel,) = tmp_path.glob("kspipe-*.whl")
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    return wheel, unpacked


def from_wheel(script: str, unpacked: Path, cwd: Path, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script.format(where=str(unpacked))],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_wheel_has_configs_and_runs_outside_the_checkout(wheel, tmp_path):
    wheel, unpacked = wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert "kspipe/conf/config.yaml" in names
    assert "kspipe/conf/experiment/omniglot_5way.yaml" in names
    result = from_wheel(RUN_FROM_WHEEL, unpacked, tmp_path)
    # The config composed from the wheel's files, so validation reached the value:
    assert "kspipe: error: workers=0 must be at least 1" in result.stderr, result.stderr
    assert result.returncode == 2


def test_wheel_has_the_public_test_kit_and_none_of_the_suites_pieces(wheel, tmp_path):
    wheel, unpacked = wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith("tests/")]
    assert (
        sorted(n.rpartition("/")[2] for n in names if n.startswith("kspipe/testing/")) == PUBLIC_KIT
    )
    # no module of the wheel defines a piece of the suite's kit (a Slurm on loopback, disk
    # mounts, the suite's jobs and constants), wherever it was put
    defines = re.compile(rf"^(?:def |class )?({'|'.join(kit.__all__)})\b\s*[=(:]", re.M)
    found = {
        name: defines.findall((unpacked / name).read_text())
        for name in names
        if name.endswith(".py")
    }
    assert {name: pieces for name, pieces in found.items() if pieces} == {}
    # in an environment of PATH alone, where a variable set by default would show
    result = from_wheel(KIT_FROM_WHEEL, unpacked, tmp_path, env={"PATH": os.environ["PATH"]})
    assert result.returncode == 0, result.stderr[-3000:]


#: The example plugin packages the README has a user install into their own environment.
EXAMPLE_PLUGINS = sorted((REPO / "plugins").glob("kspipe-*"))


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("plugin", EXAMPLE_PLUGINS, ids=lambda p: p.name)
def test_an_example_plugin_installs_into_the_suites_environment_changing_nothing(plugin, tmp_path):
    """``pip install plugins/<name>`` as the README says, into the environment the suite
    runs in, installs the plugin alone: no package of the user's is added, upgraded or
    downgraded (a pin such as ``numpy<2`` took numpy 2 down to 1.26 and pandas with it).
    pip's dry run resolves exactly as the install would and says what it would install,
    and leaves the environment as it was for the other tests.  From a copy: pip writes the
    package's metadata beside its sources."""
    source = tmp_path / plugin.name
    shutil.copytree(plugin, source, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--report", str(report)]
        + [str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    installed = {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}
    changes = [
        f"{name} {installed.get(name, '(not installed)')} -> {item['metadata']['version']}"
        for item in json.loads(report.read_text())["install"]
        if (name := canonical(item["metadata"]["name"])) != canonical(plugin.name)
    ]
    assert not changes, f"installing {plugin.name} would change the environment: {changes}"
