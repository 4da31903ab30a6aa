"""``resume=`` that cannot continue: no checkpoint, a truncated or damaged file, a state saved
by another model.  Each is one line naming the file, before anything is loaded or trained,
and the command leaves no run RUNNING or FINISHED."""

import json

import pytest

from kspipe import checkpoint
from kspipe.errors import ConfigError
from kspipe.testing import compose_config, run_kspipe, run_statuses, tiny_overrides


def programs_and_state(filters: int, scope):
    """Reptile's programs of a model with ``filters`` filters, their startup run in ``scope``."""
    import paddle

    from kspipe.reptile.programs import build_programs

    paddle.enable_static()
    cfg = compose_config([f"model.filters={filters}", "task.ways=3"])
    programs = build_programs((28, 28, 1), 3, cfg.model, 0.01, seed=0)
    executor = paddle.static.Executor(paddle.CPUPlace())
    with paddle.static.scope_guard(scope):
        executor.run(programs.startup)
    return cfg, programs, executor


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run folder with one checkpoint of a model with 16 filters."""
    import paddle

    folder = tmp_path_factory.mktemp("saved")
    scope = paddle.static.Scope()
    cfg, programs, _ = programs_and_state(16, scope)
    checkpoint.save(
        programs.train,
        scope,
        str(folder / "checkpoints"),
        4,
        {"meta_iteration": 4, "tasks_done": 8},
        1,
        cfg,
    )
    return folder


def copy_of(saved, tmp_path):
    import shutil

    shutil.copytree(saved, tmp_path / "run")
    return tmp_path / "run", checkpoint.latest(str(tmp_path / "run"))


def load_into(filters: int, path):
    import paddle

    scope = paddle.static.Scope()
    _, programs, _ = programs_and_state(filters, scope)
    return checkpoint.load(programs.train, scope, str(path))


def test_the_same_model_loads(saved):
    assert load_into(16, saved) == {"meta_iteration": 4, "tasks_done": 8}


def truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "damage, file, fragment",
    [
        (lambda ckpt: truncate(ckpt / "state.pdparams"), "state.pdparams", "cannot read"),
        (
            lambda ckpt: (ckpt / "state.pdparams").write_bytes(b"not a pickle"),
            "state.pdparams",
            "cannot read",
        ),
        (lambda ckpt: (ckpt / "state.pdparams").unlink(), "state.pdparams", "cannot read"),
        (lambda ckpt: truncate(ckpt / "state.pdopt"), "state.pdopt", "cannot read"),
        (
            lambda ckpt: (ckpt / "progress.json").write_text("{garbage"),
            "progress.json",
            "cannot read",
        ),
        (
            lambda ckpt: (ckpt / "progress.json").write_text("[4]"),
            "progress.json",
            "holds no progress record",
        ),
    ],
)
def test_a_damaged_checkpoint_is_one_line_naming_the_file(saved, tmp_path, damage, file, fragment):
    import pathlib

    run, found = copy_of(saved, tmp_path)
    damage(pathlib.Path(found))
    with pytest.raises(ConfigError) as err:
        load_into(16, run)
    message = str(err.value)
    assert message.startswith(f"resume={run}: ")
    assert f"{found}/{file}" in message and fragment in message
    assert "\n" not in message


def test_a_checkpoint_of_another_model_shape_is_refused(saved):
    with pytest.raises(
        ConfigError,
        match=r"state\.pdparams was saved by another model: "
        r"\S+ has shape \[16, .*\] there, the model has \[32, ",
    ):
        load_into(32, saved)


def test_a_checkpoint_of_another_model_is_refused(saved, tmp_path):
    import pickle

    run, found = copy_of(saved, tmp_path)
    file = f"{found}/state.pdparams"
    with open(file, "rb") as f:
        state = pickle.load(f)
    state["fc_9.w_0"] = state[next(iter(state))]
    with open(file, "wb") as f:
        pickle.dump(state, f)
    with pytest.raises(ConfigError, match="the model has no fc_9.w_0"):
        load_into(16, run)
    del state["fc_9.w_0"], state[sorted(state)[0]]
    with open(file, "wb") as f:
        pickle.dump(state, f)
    with pytest.raises(ConfigError, match="was saved by another model: it has no "):
        load_into(16, run)


@pytest.mark.parametrize(
    "where, fragment",
    [
        ("empty", "no checkpoint found there"),
        ("missing", "no such folder"),
    ],
)
def test_no_checkpoint_is_one_line(tmp_path, where, fragment):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=f"resume={tmp_path / where}: {fragment}"):
        load_into(16, tmp_path / where)


# --- through the command ------------------------------------------------------------


def kspipe(tmp_path, data, *args):
    return run_kspipe(
        "+experiment=omniglot_5way",
        *tiny_overrides(tmp_path, data),
        "train.meta_iters=1",
        "eval.baseline=false",
        *args,
        cwd=tmp_path,
        timeout=300,
    )


@pytest.mark.parametrize("case", ["shape", "progress", "none"])
def test_the_command_says_one_line_and_trains_nothing(saved, tmp_path, tiny_data, case):
    run, found = copy_of(saved, tmp_path)
    args = {"shape": ["model.filters=32"], "progress": [], "none": []}[case]
    resume = tmp_path if case == "none" else run
    if case == "progress":
        with open(f"{found}/progress.json", "w") as f:
            json.dump("garbage", f)
    result = kspipe(tmp_path, tiny_data, *args, f"run_dir={tmp_path / 'again'}", f"resume={resume}")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("kspipe: error:")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"kspipe: error: resume={resume}: ")
    named = {
        "shape": f"{found}/state.pdparams",
        "progress": f"{found}/progress.json",
        "none": "no checkpoint found there",
    }[case]
    assert named in errors[0]
    assert not (tmp_path / "again" / "checkpoints").exists()
    assert "RUNNING" not in run_statuses(tmp_path / "mlflow.db")
    assert "FINISHED" not in run_statuses(tmp_path / "mlflow.db")
