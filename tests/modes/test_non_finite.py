"""Training that goes non-finite stops the run, and ``role.embedding`` trains soundly with
Adam's defaults, with the tests' workload (tests/plugins/bags) installed as a user's plugin.

* A loss gone NaN on one worker ends the job with one line naming the worker and the
  step, its MLflow run FAILED with no NaN recorded: ``mode=local``, ``mode=pserver`` (two
  workers, sync) and ``mode=collective`` (two workers).  A NaN reported from a thread of
  the workload's own is raised when the execute stage returns.  A NaN or infinity in an
  array reported (a numpy array, a 0-d one, a numpy scalar, a Paddle tensor) is one too.
* A parameter gone NaN where no loss or metric shows it fails the run in one line naming
  the parameter, FAILED: at a checkpoint (which is not written), and when training ends
  (before the export), on any worker, whatever the workload (bags is a third party's).
* Paddle 2.6.2's Adam with ``lazy_mode=False`` (its default) updates a table from a sparse
  gradient wrongly: it reads past the gradient's rows, so a rarely seen row's moments take
  NaN or huge values, and one run differs from the next.  ``role.embedding``'s table gets a
  dense gradient with such an optimiser (and keeps its sparse one with SGD, lazy Adam ...):
  a run of ``ADAM`` (a table of 10,000 rows, ids few often and most rarely), which ended
  with an infinite moment in 1 of 3 runs and with three different test R2 before, ends with
  the parameters and Adam state of a one-process reference that makes the gradient dense
  itself, bit for bit; one parameter-server worker (sync) and two collective workers end
  with that state, float rounding apart; two parameter-server workers (async) keep their
  state finite and train the model further than one process does in an eighth of the steps.
"""

import json
import math
import pickle
import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from kspipe import testing
from kspipe.role import Role

#: Adam with Paddle's defaults on a table of 10,000 rows whose ids follow a Zipf law: rows
#: seen once in a while beside rows seen every batch (512 steps of 128 examples).
ADAM = [
    "bags.optimizer=adam",
    "bags.learning_rate=0.01",
    "bags.vocabulary=10000",
    "bags.zipf=1.3",
    "bags.batch_size=128",
    "bags.train_points=8192",
    "bags.epochs=8",
]

#: A run of 48 steps, a checkpoint after each of its 3 epochs.
SHORT = ["bags.train_points=1024", "bags.epochs=3", "bags.checkpoint_every=1"]


def run(env, folder, *overrides):
    """``kspipe +experiment=bags <overrides>`` in ``folder`` (its run folder ``folder/run``),
    recorded in the MLflow store ``folder/mlflow.db``."""
    return testing.run_kspipe(
        "+experiment=bags",
        f"tracking.uri={testing.begun_store(folder)}",
        *overrides,
        f"run_dir={folder / 'run'}",
        cwd=folder,
        env=env,
    )


@pytest.mark.parametrize(
    "overrides, line",
    [
        ([], "kspipe: error: loss is nan at train step 5"),
        (
            ["mode=pserver", "workers=2", "servers=1", "cluster.strategy=sync"],
            "kspipe: error: worker 1: loss is nan at train step 5 (its log: ",
        ),
        (
            ["mode=collective", "workers=2"],
            "kspipe: error: worker 1: loss is nan at train step 5 (its log: ",
        ),
    ],
    ids=["local", "pserver", "collective"],
)
def test_a_loss_gone_nan_fails_the_run_in_one_line(bags_env, tmp_path, overrides, line):
    """From step 5 on the last worker's targets are NaN, so its loss is: the job ends there,
    in one line that names the worker (where there are several) and the step."""
    workers = 2 if overrides else 1
    result = run(
        bags_env, tmp_path, "bags.nan_from=5", f"bags.nan_worker={workers - 1}", *overrides
    )
    testing.assert_one_line_error(result, line)
    assert testing.run_statuses(tmp_path / "mlflow.db") == ["FAILED"]
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        values = [value for (value,) in db.execute("select value from metrics")]
    assert all(math.isfinite(value) for value in values), values


def test_a_value_reported_from_another_thread_stops_the_run_when_the_stage_returns(tmp_path):
    """A monitor's thread (ctr's, beside ``train_from_dataset``) cannot stop the stage: its
    NaN is kept, not recorded, and raised on the stages' thread at its next report or when
    the execute stage returns (``Reporter.check``); so is a metric the stage returns."""
    import threading

    from kspipe.errors import NonFiniteError
    from kspipe.reporting import Reporter

    recorder = testing.HookRecorder()
    hook = testing.plugin_manager(recorder).hook
    reporter = Reporter(hook, str(tmp_path))
    reporter.metrics({"train_auc": 0.5}, step=10)
    monitor = threading.Thread(target=reporter.metrics, args=({"train_auc": math.nan}, 20))
    monitor.start()
    monitor.join()
    assert recorder.metrics() == {"train_auc": 0.5}
    with pytest.raises(NonFiniteError, match=r"^train_auc is nan at step 20$"):
        reporter.progress("train", 30, 40, {"loss": 0.25})
    with pytest.raises(NonFiniteError, match=r"^train_auc is nan at step 20$"):
        reporter.check({"test_auc": 0.5})
    with pytest.raises(NonFiniteError, match=r"^test_logloss is inf in the execute stage"):
        Reporter(hook, str(tmp_path)).check({"test_auc": 0.5, "test_logloss": math.inf})


@pytest.mark.parametrize(
    "value, said",
    [
        (np.array([0.5, np.nan]), "holds nan (element [1]; 1 of its 2 values are not finite)"),
        (np.array(np.inf), "is inf"),
        (np.float32(-np.inf), "is -inf"),
        (np.full((2, 3), np.nan), "holds nan (element [0, 0]; 6 of its 6 values are not finite)"),
        ([0.25, math.nan], "holds nan (element [1]; 1 of its 2 values are not finite)"),
    ],
    ids=["array", "0-d", "numpy-scalar", "matrix", "list"],
)
def test_an_array_reported_with_a_non_finite_value_stops_the_run(tmp_path, value, said):
    """A metric or a progress value that is an array (a fetched loss, an AUC's histogram)
    is checked element by element, as a plain number is; one whose values are all finite
    goes through as it is."""
    from kspipe.errors import NonFiniteError
    from kspipe.reporting import Reporter

    recorder = testing.HookRecorder()
    hook = testing.plugin_manager(recorder).hook
    reporter = Reporter(hook, str(tmp_path))
    reporter.metrics({"train_auc": np.array([0.5, 0.75]), "fetched": np.float32(2.0)}, step=1)
    with pytest.raises(NonFiniteError, match=rf"^train_auc {re.escape(said)} at step 3$"):
        reporter.metrics({"train_auc": value}, step=3)
    with pytest.raises(NonFiniteError, match=rf"^loss {re.escape(said)} at train step 4$"):
        Reporter(hook, str(tmp_path)).progress("train", 4, 10, {"loss": value})
    np.testing.assert_array_equal(recorder.metrics()["train_auc"], [0.5, 0.75])


def test_a_paddle_tensor_reported_with_a_nan_stops_the_run(tmp_path):
    import paddle

    from kspipe.errors import NonFiniteError
    from kspipe.reporting import Reporter

    reporter = Reporter(testing.plugin_manager(testing.HookRecorder()).hook, str(tmp_path))
    with paddle.base.dygraph.guard():  # an eager tensor, whatever mode earlier tests left
        loss = paddle.to_tensor([1.0, 2.0, math.nan])
    with pytest.raises(NonFiniteError, match=r"^loss holds nan \(element \[2\]; 1 of its 3 "):
        reporter.progress("train", 7, 10, {"loss": loss})


@pytest.mark.parametrize(
    "overrides, line, checkpoints",
    [
        (
            ["bags.nan_parameter=out.b"],
            "kspipe: error: parameter out.b is nan at the end of training",
            ["checkpoint-0000002", "checkpoint-0000003"],
        ),
        (
            ["bags.nan_parameter=table", "bags.nan_parameter_at=checkpoint"],
            "kspipe: error: parameter table holds nan (element [0, 0]; 1 of its 800 values are "
            "not finite) at the checkpoint of step 3 (not written)",
            ["checkpoint-0000001", "checkpoint-0000002"],
        ),
        (
            ["bags.nan_parameter=out.b", "bags.nan_worker=1", "mode=collective", "workers=2"],
            "kspipe: error: worker 1: parameter out.b is nan at the end of training (its log: ",
            ["checkpoint-0000002", "checkpoint-0000003"],
        ),
    ],
    ids=["end", "checkpoint", "collective"],
)
def test_a_parameter_gone_nan_fails_the_run_naming_it(
    bags_env, tmp_path, overrides, line, checkpoints
):
    """No loss or metric shows the NaN (it comes after the last step's loss, or after the
    test metrics): the run fails at the checkpoint, whose folder is not written, or before
    the export and metrics.json, its MLflow run FAILED.  On worker 1 of two the same."""
    result = run(bags_env, tmp_path, *SHORT, *overrides)
    testing.assert_one_line_error(result, line)
    assert testing.run_statuses(tmp_path / "mlflow.db") == ["FAILED"]
    if "workers=2" not in overrides:  # the other worker's ended well, and wrote it
        assert not (tmp_path / "run" / "metrics.json").exists()
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("checkpoint-*"))
    assert kept == checkpoints


@pytest.mark.parametrize(
    "optimizer, options, sparse",
    [
        ("Adam", {}, False),
        ("AdamW", {}, False),
        ("Adamax", {}, False),
        ("Adam", {"lazy_mode": True}, True),
        ("SGD", {}, True),
        ("Momentum", {}, True),
        ("Adagrad", {}, True),
        ("RMSProp", {}, True),
        ("Lamb", {}, True),
    ],
)
def test_a_table_is_sparse_only_for_an_optimiser_that_updates_it_soundly(
    optimizer, options, sparse
):
    """The table's gradient, whether ``role.embedding`` comes before
    ``role.distributed_optimizer`` (as a workload's program and compile stages call them)
    or after it."""
    import paddle

    paddle.enable_static()
    for embedding_first in (True, False):
        role, main, startup = Role(), paddle.static.Program(), paddle.static.Program()
        with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
            ids = paddle.static.data("ids", [None, 3], "int64")
            if embedding_first:
                rows = role.embedding(ids, [50, 4], paddle.ParamAttr(name="table"))
            made = getattr(paddle.optimizer, optimizer)(0.1, **options)
            distributed = role.distributed_optimizer(made)
            if not embedding_first:
                rows = role.embedding(ids, [50, 4], paddle.ParamAttr(name="table"))
            distributed.minimize(paddle.mean(rows))
        gradient = main.global_block().var("table@GRAD").type
        kind = paddle.base.core.VarDesc.VarType
        assert gradient == (kind.SELECTED_ROWS if sparse else kind.LOD_TENSOR), embedding_first


@pytest.fixture(scope="module")
def adam_local(bags_env, tmp_path_factory):
    """The ``ADAM`` run in ``mode=local``: its run folder."""
    folder = tmp_path_factory.mktemp("adam-local")
    result = run(bags_env, folder, *ADAM)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "run"


class DenseTables(Role):
    """The reference's role: its own table with a dense gradient, the optimiser as given."""

    def embedding(self, ids, size, param_attr, feeding="executor"):
        import paddle

        return paddle.static.nn.embedding(ids, size=size, is_sparse=False, param_attr=param_attr)

    def distributed_optimizer(self, optimizer, strategy=None, feeding="executor"):
        return optimizer


def dense_reference(folder, monkeypatch):
    """The ``ADAM`` model trained in this process on a dense gradient the reference asks
    Paddle for itself, by bags' own stages; what it saved, in ``folder``."""
    import paddle

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "plugins" / "bags"))
    from kspipe_bags import plugin as bags

    cfg = testing.compose_config(
        ["+experiment=bags", *ADAM], ["pkg://kspipe_bags.conf"], {"bags": bags.BagsConfig}
    )
    role, reporter = DenseTables(), testing.QuietReporter()
    reporter.run_dir = str(folder)
    paddle.enable_static()
    dataset = bags.kspipe_read_dataset(cfg, role)
    programs = bags.kspipe_build_program(cfg, dataset, role)
    programs = bags.kspipe_compile_program(cfg, role, programs)
    executor, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    bags.kspipe_execute(cfg, role, dataset, programs, executor, scope, reporter)
    return folder


def saved_state(run_dir) -> dict:
    """Every parameter and optimiser value a bags run saved (``persistables.pd*``)."""
    state = {}
    for suffix in ("pdparams", "pdopt"):
        with open(run_dir / f"persistables.{suffix}", "rb") as f:
            state.update(pickle.load(f))
    return {name: np.asarray(value) for name, value in state.items()}


@pytest.mark.filterwarnings("ignore::DeprecationWarning:paddle.base.layers.math_op_patch")  # A - B
def test_adam_on_a_table_trains_as_on_its_dense_gradient(adam_local, tmp_path, monkeypatch):
    """mode=local: the parameters and Adam's moments of the dense reference, bit for bit,
    all finite."""
    reference = saved_state(dense_reference(tmp_path, monkeypatch))
    state = saved_state(adam_local)
    assert set(state) == set(reference) and "table_moment2_0" in state
    for name, value in reference.items():
        assert np.isfinite(value).all(), name
        np.testing.assert_array_equal(state[name], value, err_msg=name)


@pytest.mark.parametrize(
    "cluster",
    [
        ["mode=pserver", "workers=1", "servers=1", "cluster.strategy=sync"],
        ["mode=collective", "workers=2"],
    ],
    ids=["pserver", "collective"],
)
def test_adam_on_a_table_in_a_cluster_trains_the_local_model(
    adam_local, bags_env, tmp_path, cluster
):
    """The local run's parameters and Adam state, float rounding apart: one worker of a
    sync parameter-server job (the server adds each step's change to its copy and the worker
    takes that back: old + (new - old) rounds in float32), two collective workers (the mean
    of their halves' gradients rounds otherwise than the whole batch's)."""
    result = run(bags_env, tmp_path, *ADAM, *cluster, "tracking.enabled=false")
    assert result.returncode == 0, result.stderr[-3000:]
    local, state = saved_state(adam_local), saved_state(tmp_path / "run")
    assert set(state) == set(local)
    for name, value in local.items():
        assert np.isfinite(state[name]).all(), name
        np.testing.assert_allclose(state[name], value, rtol=0, atol=1e-5, err_msg=name)


def test_adam_on_a_table_on_parameter_servers_async(bags_env, tmp_path):
    """The job that ended FINISHED with a NaN log loss before: two workers, async, Adam's
    defaults on role.embedding's table.  Its state stays finite and it trains the model
    further than one process does in an eighth of the steps.  Async applies each worker's
    steps as they come, on parameters as stale as the machine's load makes them, so its R2
    is no one process's: 0.738-0.740 alone on a 2-core EPYC (one process: 0.737 in 8
    epochs, 0.704 in 2, 0.652 in 1), 0.712 under a whole suite's load in CI."""
    result = run(
        bags_env,
        tmp_path,
        *ADAM,
        "mode=pserver",
        "workers=2",
        "servers=1",
        "cluster.strategy=async",
        "tracking.enabled=false",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name, value in saved_state(tmp_path / "run").items():
        assert value.dtype.kind != "f" or np.isfinite(value).all(), name
    r2 = json.loads((tmp_path / "run" / "metrics.json").read_text())["test_r2"]
    one_epoch = tmp_path / "one-epoch"
    one_epoch.mkdir()
    result = run(bags_env, one_epoch, *ADAM, "bags.epochs=1", "tracking.enabled=false")
    assert result.returncode == 0, result.stderr[-3000:]
    floor = json.loads((one_epoch / "run" / "metrics.json").read_text())["test_r2"]
    assert r2 > floor, (r2, floor)
