"""The ``kspipe`` command as a user runs it: bad input gives one clear line, no traceback,
a non-zero exit, and leaves no FINISHED run behind."""

import shutil
import sys

import pytest

from kspipe.testing import assert_one_line_error, run_kspipe, run_statuses, tiny_overrides


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["+experiment=omniglot_6way"], ["unknown experiment 'omniglot_6way'", "omniglot_5way"]),
        (["mode=ring"], ["unknown mode 'ring'"]),
        (["workers=0"], ["workers=0 must be at least 1"]),
        (["task.shots=0"], ["task.shots=0 must be at least 1"]),
        (["train.meta_iters=-5"], ["train.meta_iters=-5 must be at least 0"]),
        (["train.inner_iters=-1"], ["train.inner_iters=-1"]),
        (["eval.tasks=many"], ["eval.tasks=many: must be an integer"]),
        (["stages.dataset=nowhere"], ["stages.dataset='nowhere'", "open_ks"]),
        (["dataset.name=cifar"], ["dataset.name='cifar'"]),
        (["dataset.name=miniimagenet", "dataset.root=null"], ["has no embedded data set"]),
        (["dataset.name=miniimagenet"], ["has no 'train' folder"]),
        (["run_dir=/proc/kspipe-run"], ["run_dir=/proc/kspipe-run: cannot make the run folder"]),
        # the common slips: an experiment set, not added; a group's key given at the top
        (
            ["experiment=omniglot_5way"],
            ["experiment=omniglot_5way: an experiment is added", "+experiment=omniglot_5way"],
        ),
        (["meta_iters=10"], ["meta_iters=10: no such key; did you mean train.meta_iters=10?"]),
    ],
)
def test_bad_config(tmp_path, args, fragments):
    result = run_kspipe(
        "+experiment=omniglot_5way", *tiny_overrides(tmp_path, tmp_path), *args, cwd=tmp_path
    )
    assert_one_line_error(result, *fragments)
    assert "FINISHED" not in run_statuses(tmp_path / "mlflow.db")


@pytest.fixture
def data_copy(tmp_path, tiny_data):
    copy = tmp_path / "data"
    shutil.copytree(tiny_data, copy)
    return copy


def first_character(root):
    return sorted((root / "images_background").glob("*/*"))[0]


@pytest.mark.parametrize(
    "damage, args, fragments",
    [
        (lambda root: shutil.rmtree(root), [], ["does not exist"]),
        (lambda root: [shutil.rmtree(p) for p in root.iterdir()], [], ["is empty"]),
        (
            lambda root: (
                first_character(root) / sorted(first_character(root).iterdir())[1].name
            ).write_bytes(b"\x89PNG broken"),
            [],
            ["cannot read image", ".png"],
        ),
        (
            lambda root: [p.unlink() for p in sorted(first_character(root).iterdir())[2:]],
            ["task.shots=2"],
            ["has 2 images, fewer than the 3"],
        ),
        (lambda root: None, ["task.ways=11"], ["task.ways=11 is more than the 10 test classes"]),
    ],
)
def test_bad_data(tmp_path, data_copy, damage, args, fragments):
    damage(data_copy)
    result = run_kspipe(
        "+experiment=omniglot_5way",
        *tiny_overrides(tmp_path, data_copy),
        "train.meta_iters=1",
        "eval.baseline=false",
        *args,
        cwd=tmp_path,
    )
    assert_one_line_error(result, *fragments)
    if "cannot read image" in fragments:
        assert first_character(data_copy).name in result.stderr
    assert "FINISHED" not in run_statuses(tmp_path / "mlflow.db")


def test_hydra_is_given_the_command_line_for_its_call_only(monkeypatch, capsys):
    from kspipe.cli.command import run_hydra
    from kspipe.config.schema import register_schemas

    register_schemas(None)
    monkeypatch.setattr(sys, "argv", ["kspipe", "workers=oops"])
    ran = []
    run_hydra(ran.append, ["--cfg", "job", "workers=3"])  # prints the config, runs no job
    assert "workers: 3" in capsys.readouterr().out and ran == []
    assert sys.argv == ["kspipe", "workers=oops"]


def test_a_job_process_of_another_launcher_builds_its_own_plugin_manager():
    """submitit pickles the task into each Slurm job: its plugin manager stays here."""
    import cloudpickle

    from kspipe.cli.jobs import Jobs

    task = cloudpickle.loads(cloudpickle.dumps(Jobs(object(), ["workers"]).run))
    assert task.__self__.pm is None and task.__self__.swept == ["workers"]


def test_a_job_describes_its_workload_once(tmp_path, tiny_data, monkeypatch, capsys):
    """The run and the command's closing line share one description of the workload."""
    from kspipe.cli.command import run_hydra
    from kspipe.cli.jobs import Jobs
    from kspipe.config.schema import register_schemas
    from kspipe.registry.plugin_manager import get_plugin_manager

    pm = get_plugin_manager(load_entrypoints=False)
    called = []
    pm.add_hookcall_monitoring(
        lambda name, impls, kwargs: called.append(name), lambda outcome, name, impls, kwargs: None
    )
    register_schemas(None)
    monkeypatch.setattr(sys, "argv", ["kspipe"])
    run_hydra(
        Jobs(pm, []).run,
        [
            "+experiment=omniglot_5way",
            *tiny_overrides(tmp_path, tiny_data),
            "tracking.enabled=false",
        ],
    )
    assert called.count("kspipe_describe_workload") == 1
    assert "kspipe: done: test_accuracy " in capsys.readouterr().out


def test_help_says_how_to_run_and_shows_the_config_the_overrides_compose(tmp_path):
    """``kspipe --help`` answers without running anything (no run folder, no store), with
    the experiments to choose from and the config its other arguments compose; ``-m``
    composes a sweep's first job; a bad value is the usual one line; with another of
    Hydra's flags, Hydra's help."""
    result = run_kspipe("mode=pserver", "workers=3", "--help", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("kspipe: a plugin-based pipeline")
    assert "omniglot_5way" in next(
        line for line in result.stdout.splitlines() if line.startswith("experiments")
    )
    assert "\nmodes (mode=NAME): collective, local, pserver\n" in result.stdout
    assert "\nmode: pserver\nworkers: 3\n" in result.stdout
    assert list(tmp_path.iterdir()) == []
    swept = run_kspipe("-m", "workers=2,4", "-h", cwd=tmp_path, timeout=120)
    assert swept.returncode == 0 and "\nworkers: 2\n" in swept.stdout, swept.stderr
    assert_one_line_error(
        run_kspipe("eval.tasks=many", "--help", cwd=tmp_path, timeout=120),
        "eval.tasks=many: must be an integer",
    )
    hydras = run_kspipe("--help", "--info", cwd=tmp_path, timeout=120)  # Hydra answers
    assert hydras.returncode == 0 and "Hydra" in hydras.stdout, hydras.stderr


def test_a_command_that_prints_its_config_makes_no_run_folder(tmp_path):
    """``kspipe --cfg job`` (and Hydra's other answers) resolve the config's run folder,
    named by the time, without making it."""
    for flags in (["--cfg", "job"], ["--cfg", "all", "--resolve"], ["--info", "all"]):
        result = run_kspipe(*flags, "workers=3", cwd=tmp_path, timeout=120)
        assert result.returncode == 0, (flags, result.stderr)
        assert list(tmp_path.iterdir()) == [], flags
    assert "workers: 3" in run_kspipe("--cfg", "job", "workers=3", cwd=tmp_path).stdout


def test_a_reader_that_is_gone_ends_the_command_quietly(tmp_path):
    """``kspipe plugins | head -1``: the pipe closes under the command (here before it
    writes at all); it ends as a shell's own commands do (141, SIGPIPE's), with no
    traceback."""
    import os
    import subprocess

    read, write = os.pipe()
    command = subprocess.Popen(
        [sys.executable, "-m", "kspipe", "plugins"],
        cwd=tmp_path,
        stdout=write,
        stderr=subprocess.PIPE,
    )
    os.close(write)
    os.close(read)  # the reader is gone
    err = command.stderr.read().decode()
    assert command.wait(timeout=60) == 141, err
    assert err == ""


def test_a_job_whose_reader_is_gone_ends_quietly_with_its_run_recorded(tmp_path, tiny_data):
    """``kspipe ... | head -1``: the job runs (its progress is on stderr), and its closing
    line meets a closed pipe: 141 and no traceback (it went through Hydra's error report),
    the run's files written and its MLflow run FINISHED."""
    import os
    import subprocess

    read, write = os.pipe()
    command = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kspipe",
            "+experiment=omniglot_5way",
            *tiny_overrides(tmp_path, tiny_data),
            "train.meta_iters=1",
            "eval.baseline=false",
        ],
        cwd=tmp_path,
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write)
    os.close(read)
    err = command.stderr.read()
    assert command.wait(timeout=300) == 141, err[-3000:]
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    assert (tmp_path / "run" / "metrics.json").is_file()
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"]
