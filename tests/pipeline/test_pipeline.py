"""Whole runs through the stage registry, recorded in a real MLflow store."""

import os
import pickle

import numpy as np
import pytest
from mlflow import MlflowClient

from kspipe import hookimpl
from kspipe.pipeline import run
from kspipe.testing import HookRecorder, compose_config, plugin_manager, tiny_overrides


def only_run(cfg):
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    runs = client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
    assert len(runs) == 1
    return client, runs[0]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_data):
    """One tiny run, recorded by a HookRecorder: its config, metrics and recorder."""
    tmp = tmp_path_factory.mktemp("tiny")
    cfg = compose_config(["+experiment=omniglot_5way", *tiny_overrides(tmp, tiny_data)])
    recorder = HookRecorder()
    return cfg, run(cfg, plugin_manager(("recorder", recorder))), recorder


def test_run_trains_evaluates_saves_and_records(tiny_run):
    cfg, metrics, recorder = tiny_run
    for name in ("test_accuracy", "baseline_test_accuracy", "train_accuracy"):
        assert 0.0 <= metrics[name] <= 1.0
        assert metrics[name + "_ci95"] >= 0.0
    assert metrics["tasks_per_s"] > 0
    names = [n for n in recorder.names() if not n.endswith("_stage")]
    assert (
        names[:2] == ["kspipe_check_config", "kspipe_run_start"] and names[-1] == "kspipe_run_end"
    )
    stages = [(n, kw["stage"]) for n, kw in recorder.calls if n.endswith("_stage")]
    assert stages == [
        (when, stage)
        for stage in ("role", "dataset", "program", "compile", "execute", "save")
        for when in ("kspipe_before_stage", "kspipe_after_stage")
    ]
    assert "kspipe_run_error" not in names
    assert {"meta-train", "baseline", "evaluate"} <= {
        kw["task"] for n, kw in recorder.calls if n == "kspipe_progress"
    }

    client, record = only_run(cfg)
    assert record.info.status == "FINISHED"
    assert record.data.params["train.meta_iters"] == "4"
    assert record.data.params["task.ways"] == "3"
    assert record.data.metrics["test_accuracy"] == pytest.approx(metrics["test_accuracy"])
    assert record.data.metrics["baseline_test_accuracy"] == pytest.approx(
        metrics["baseline_test_accuracy"]
    )
    history = client.get_metric_history(record.info.run_id, "curve/test_accuracy")
    assert [m.step for m in history] == [2, 4]
    artifacts = {a.path for a in client.list_artifacts(record.info.run_id)}
    assert {"config.yaml", "inference_model", "learning_curve.png"} <= artifacts
    model_files = {a.path for a in client.list_artifacts(record.info.run_id, "inference_model")}
    assert "inference_model/model.pdmodel" in model_files


def test_inference_model_loads_and_classifies_a_task(tiny_run, tiny_data):
    """The exported model is the trained one: its weights are those of the run's last
    checkpoint (written when meta-training ended), bit for bit."""
    import paddle

    from kspipe.fewshot.data import read_omniglot, sample_task
    from kspipe.reptile.tasks import nchw

    cfg = tiny_run[0]
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        program, feeds, fetches = paddle.static.load_inference_model(
            os.path.join(cfg.run_dir, "inference_model", "model"), exe
        )
        test = read_omniglot(str(tiny_data), train_characters=20, seed=0)[2]
        task = sample_task(test, ways=3, shots=1, queries=2, rng=np.random.default_rng(0))
        (logits,) = exe.run(program, feed={feeds[0]: nchw(task.query_x)}, fetch_list=fetches)
    assert logits.shape == (6, 3) and np.isfinite(logits).all()
    assert os.path.isfile(os.path.join(cfg.run_dir, "inference_model", "kspipe_config.yaml"))

    last = os.path.join(cfg.run_dir, "checkpoints", f"checkpoint-{cfg.train.meta_iters:07d}")
    with open(os.path.join(last, "state.pdparams"), "rb") as f:
        trained = pickle.load(f)
    exported = [
        v.name for v in program.list_vars() if v.persistable and v.name not in ("feed", "fetch")
    ]
    assert exported and set(exported) <= set(trained), (exported, sorted(trained))
    for name in exported:
        np.testing.assert_array_equal(
            np.array(scope.find_var(name).get_tensor()), trained[name], err_msg=name
        )


class InterruptAt:
    """Stops a run like Ctrl-C once meta-training reports ``step``."""

    def __init__(self, step):
        self.step = step

    @hookimpl
    def kspipe_progress(self, task, step, total, values):
        if task == "meta-train" and step == self.step:
            raise KeyboardInterrupt


def test_resume_continues_to_the_same_result(tiny_cfg, tmp_path):
    import paddle

    common = ("train.meta_iters=6", "train.checkpoint_every=3")
    run(tiny_cfg(*common, f"run_dir={tmp_path / 'straight'}"), plugin_manager())

    interrupted = tiny_cfg(*common, f"run_dir={tmp_path / 'first'}")
    with pytest.raises(KeyboardInterrupt):
        run(interrupted, plugin_manager(InterruptAt(5)))
    client = MlflowClient(tracking_uri=interrupted.tracking.uri)
    statuses = [
        r.info.status
        for r in client.search_runs([client.get_experiment_by_name("kspipe").experiment_id])
    ]
    assert sorted(statuses) == ["FINISHED", "KILLED"]

    resumed = tiny_cfg(*common, f"run_dir={tmp_path / 'resumed'}", f"resume={tmp_path / 'first'}")
    metrics = run(resumed, plugin_manager())
    assert "baseline_test_accuracy" not in metrics  # a resumed run does not re-measure it

    def weights(run_dir):
        return paddle.load(
            os.path.join(run_dir, "checkpoints", "checkpoint-0000006", "state.pdparams")
        )

    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for name in a:
        # to float rounding: another test in this process may have set Paddle's math threads
        # (compile.execution_strategy.num_threads), which changes summation order
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
