"""A command given no run folder gets one of its own, named by the time: two commands
started in the same second never share one (their checkpoints and metrics would
overwrite each other's)."""

import os
import subprocess
import sys
import time
from datetime import datetime, timedelta

from kspipe.testing import run_kspipe, tiny_overrides


def test_processes_asking_at_once_for_one_name_each_get_a_folder(tmp_path):
    name = "outputs/2026-01-01/10-00-00"
    go = tmp_path / "go"
    ask = (
        "import os, sys, time\n"
        "from kspipe.job import new_folder\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.001)\n"
        f"first = new_folder({name!r})\n"
        f"assert new_folder({name!r}) == first  # once a process has one, it keeps it\n"
        "print(first)\n"
    )
    asking = [
        subprocess.Popen(
            [sys.executable, "-c", ask], cwd=tmp_path, text=True, stdout=subprocess.PIPE
        )
        for _ in range(4)
    ]
    time.sleep(1)  # every process waiting
    go.touch()
    got = sorted(p.communicate(timeout=60)[0].strip() for p in asking)
    assert [p.returncode for p in asking] == [0] * 4
    assert got == [name, f"{name}-2", f"{name}-3", f"{name}-4"]
    assert all((tmp_path / folder).is_dir() for folder in got)


def test_a_command_whose_time_is_taken_runs_in_a_folder_of_its_own(tmp_path, tiny_data):
    """Every folder the command could be named for (the next five minutes') is taken, as
    by another command started in the same second: it runs in ``<time>-2``, and leaves the
    taken ones as they were."""
    start = datetime.now()
    taken = set()
    for second in range(300):
        moment = start + timedelta(seconds=second)
        folder = tmp_path / "outputs" / moment.strftime("%Y-%m-%d") / moment.strftime("%H-%M-%S")
        folder.mkdir(parents=True, exist_ok=True)
        taken.add(folder)
    args = [a for a in tiny_overrides(tmp_path, tiny_data) if not a.startswith("run_dir=")]
    result = run_kspipe(
        "+experiment=omniglot_5way",
        *args,
        "train.meta_iters=1",
        "eval.tasks=2",
        "eval.train_tasks=2",
        "eval.baseline=false",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    done = result.stdout.strip().splitlines()[-1]
    run = done.rpartition("(run folder ")[2].rstrip(")")
    assert run.endswith("-2") and os.path.isdir(run) and (tmp_path / run / "metrics.json").is_file()
    assert run[:-2] in {str(folder) for folder in taken}
    assert all(not any(folder.iterdir()) for folder in taken)


def test_a_refused_job_leaves_no_empty_jobs_log(tmp_path):
    """Hydra's job log (``jobs.log``) stayed empty in every run folder: kspipe says what it
    has to on the console, so Hydra writes none."""
    result = run_kspipe(
        "+experiment=omniglot_5way", f"dataset.root={tmp_path / 'missing'}", cwd=tmp_path
    )
    assert "does not exist" in result.stderr, result.stderr[-3000:]
    assert list(tmp_path.glob("outputs/**/jobs.log")) == []
