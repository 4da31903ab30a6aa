"""A run writes only where it should: from an empty folder, a ctr run (local and on a
parameter-server cluster) leaves Hydra's output folder (holding the run folder) and the
MLflow store, nothing else, nothing in the temporary folder and nothing in the user's home
(MLflow's usage reporting, off in kspipe's runs, would write its id there; Paddle's
import makes an empty cache folder); Paddle's debug descriptions land in the run folder."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ALLOWED = {"outputs", "mlflow.db", "mlruns"}  # Hydra's output folder, the MLflow store


@pytest.mark.parametrize("mode", ["local", "pserver"])
def test_a_ctr_run_writes_nothing_outside_its_run_folder(tmp_path, mode):
    work, cache, temporary = tmp_path / "work", tmp_path / "cache", tmp_path / "tmp"
    home = tmp_path / "home"
    for folder in (work, temporary, home):
        folder.mkdir()
    env = {
        name: value
        for name, value in os.environ.items()  # a user's shell, not a test's
        if name not in ("PYTEST_CURRENT_TEST", "CI") and not name.startswith("XDG_")
    }
    env.update(KSPIPE_CACHE_DIR=str(cache), TMPDIR=str(temporary), HOME=str(home))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kspipe.cli.command",
            "+experiment=ctr_datafeed",
            f"mode={mode}",
            "workers=2",
            "ctr.epochs=1",
            "datafeed.generated.lines_per_file=300",
            "cluster.timeout_s=240",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(os.listdir(work)) <= ALLOWED, sorted(os.listdir(work))
    assert os.listdir(temporary) == []  # MLflow's store lock file went with kspipe's folder
    assert [str(p.relative_to(home)) for p in home.rglob("*") if p.is_file()] == []
    (run_dir,) = [p for p in (work / "outputs").glob("*/*") if p.is_dir()]
    assert (run_dir / "inference_model" / "model.pdmodel").is_file()
    assert list((run_dir / "debug").glob("*_train_desc.prototxt"))
    assert not list(work.glob("*.prototxt")) and not (work / "http.log").exists()


def test_the_checkout_holds_no_generated_file():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    generated = [
        f
        for f in tracked
        if f.endswith((".prototxt", ".log", ".db", ".pyc"))
        and not f.startswith(("tests/", "examples/"))
    ]
    assert generated == []
