"""Incremental training: ``init_from=<run>`` starts a new run from a finished run's model, in
any mode: trained on a parameter-server cluster, continued in one process, and back.  Its
first evaluation (the baseline) is the source's final one, on the same test tasks.  (ctr,
whose tables the servers keep as sparse tables: workloads/test_ctr.py.)"""

import json
import shutil
from pathlib import Path

import pytest

from kspipe import hookimpl
from kspipe.contracts import Workload
from kspipe.errors import ConfigError
from kspipe.pipeline import check, prepare, run
from kspipe.testing import (
    assert_one_line_error,
    compose_config,
    install_plugin,
    plugin_env,
    plugin_manager,
    run_kspipe,
    tiny_overrides,
)

CLASSIFIER = (
    Path(__file__).resolve().parents[2] / "plugins" / "kspipe-classifier" / "kspipe_classifier"
)


def common(tmp_path, tiny_data):
    return [
        "+experiment=omniglot_5way",
        *tiny_overrides(tmp_path, tiny_data),
        "eval.tasks=20",
        "eval.interval=0",
        "train.meta_iters=4",
    ]


def kspipe(tmp_path, *args):
    """The metrics of ``kspipe <args>`` run in ``tmp_path``, which must succeed (the last
    argument is ``run_dir=<folder>``)."""
    result = run_kspipe(*args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((tmp_path / args[-1].split("=", 1)[1] / "metrics.json").read_text())


@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_data):
    """A local run; a 2-worker sync cluster run from it; a local run from that."""
    tmp = tmp_path_factory.mktemp("incremental")
    args = common(tmp, tiny_data)
    local = kspipe(tmp, *args, f"run_dir={tmp / 'local'}")
    cluster = kspipe(
        tmp,
        *args,
        "mode=pserver",
        "workers=2",
        "cluster.strategy=sync",
        f"init_from={tmp / 'local'}",
        f"run_dir={tmp / 'cluster'}",
    )
    back = kspipe(tmp, *args, f"init_from={tmp / 'cluster'}", f"run_dir={tmp / 'back'}")
    return tmp, local, cluster, back


def test_a_cluster_run_starts_from_a_local_runs_model(chain):
    _, local, cluster, _ = chain
    assert cluster["baseline_test_accuracy"] == local["test_accuracy"]
    assert cluster["baseline_test_accuracy_ci95"] == local["test_accuracy_ci95"]
    assert local["baseline_test_accuracy"] != local["test_accuracy"]  # the source trained


def test_a_local_run_starts_from_a_cluster_runs_model(chain):
    _, _, cluster, back = chain
    assert back["baseline_test_accuracy"] == cluster["test_accuracy"]
    assert back["baseline_test_accuracy_ci95"] == cluster["test_accuracy_ci95"]


def test_a_save_persistables_folder_is_a_source(chain, tmp_path, tiny_data):
    """OpenKS's ``save_persistables(exe, dir)`` writes ``dir/persistables.pdparams`` in the
    format of a checkpoint's state: init_from reads it too."""
    tmp, local, _, _ = chain
    saved = tmp_path / "saved"
    saved.mkdir()
    for suffix in ("pdparams", "pdopt"):  # what paddle.static.save writes, as a checkpoint
        shutil.copy(
            tmp / "local" / "checkpoints" / "checkpoint-0000004" / f"state.{suffix}",
            saved / f"persistables.{suffix}",
        )
    metrics = run(
        compose_config([*common(tmp_path, tiny_data), "train.meta_iters=1", f"init_from={saved}"]),
        plugin_manager(),
    )
    assert metrics["baseline_test_accuracy"] == local["test_accuracy"]
    assert metrics["baseline_test_accuracy_ci95"] == local["test_accuracy_ci95"]


def bad(tmp_path, tiny_data, *overrides):
    with pytest.raises(ConfigError) as raised:
        run(compose_config([*common(tmp_path, tiny_data), *overrides]), plugin_manager())
    return str(raised.value)


def test_a_source_of_another_model_or_workload_is_one_line(chain, tmp_path, tiny_data):
    tmp = chain[0]
    message = bad(tmp_path, tiny_data, "model.filters=8", f"init_from={tmp / 'local'}")
    assert "was saved by another model" in message and "shape" in message
    other = tmp_path / "other"
    shutil.copytree(tmp / "local" / "checkpoints", other)
    (config,) = other.glob("checkpoint-0000004/config.yaml")
    config.write_text(config.read_text().replace("program: reptile", "program: ctr"))
    message = bad(tmp_path, tiny_data, f"init_from={other}")
    assert message.endswith("saved by the ctr workload, this run is reptile")
    assert "no such folder" in bad(tmp_path, tiny_data, f"init_from={tmp_path / 'nowhere'}")
    assert "give one of them" in bad(
        tmp_path, tiny_data, f"init_from={tmp / 'local'}", f"resume={tmp / 'local'}"
    )


def test_a_bad_source_fails_a_cluster_before_any_process_starts(chain, tmp_path, tiny_data):
    result = run_kspipe(
        *common(tmp_path, tiny_data),
        "mode=pserver",
        "workers=2",
        f"init_from={tmp_path / 'nowhere'}",
        cwd=tmp_path,
        timeout=120,
    )
    assert_one_line_error(result, f"init_from={tmp_path / 'nowhere'}: no such folder")
    assert not (tmp_path / "run" / "debug").exists()  # no process was started


# --- what a workload declares: init_from needs starts_from, resume and restarts resumes ---


class Declared:
    """A workload that declares only ``resumes``: its name and nothing else (the pipeline's
    check asks no other stage of it)."""

    def __init__(self, name: str, resumes: bool):
        self.name, self.resumes = name, resumes

    @hookimpl
    def kspipe_describe_workload(self, cfg):
        return Workload(name=self.name, headline="loss", rate="steps_per_s", resumes=self.resumes)


def checked(tmp_path, *overrides):
    """The workload ``pipeline.check`` finds for a run of ``stages.program=<overrides>``
    with the workloads ``still`` (which does not resume) and ``goes_on`` (which does)."""
    pm = plugin_manager(("still", Declared("still", False)), ("goes_on", Declared("goes_on", True)))
    return check(compose_config([f"run_dir={tmp_path / 'run'}", *overrides]), pm)


def test_a_workload_that_does_not_resume_refuses_resume_and_restarts(tmp_path):
    with pytest.raises(ConfigError) as refused:
        checked(tmp_path, "stages.program=still", f"resume={tmp_path}")
    assert str(refused.value) == (
        f"resume={tmp_path}: the still workload does not declare resumes=True, which kspipe "
        f"asks since 0.2.0 of a workload given resume= (CHANGELOG.md); a plugin built for an "
        f"older kspipe declares Workload(resumes=True) if its execute stage loads the "
        f"checkpoint resume= names (kspipe.api.load_checkpoint)"
    )
    with pytest.raises(ConfigError) as refused:
        checked(tmp_path, "stages.program=still", "mode=pserver", "cluster.max_restarts=1")
    assert str(refused.value).startswith(
        "cluster.max_restarts=1: the still workload does not declare resumes=True, which "
        "kspipe asks since 0.2.0 of a workload a restart resumes (CHANGELOG.md); "
    )
    assert str(refused.value).endswith(
        "; else set cluster.max_restarts=0 (it would start over from nothing)"
    )
    assert not checked(tmp_path, "stages.program=still", "cluster.max_restarts=0").resumes


def test_a_plugin_built_for_an_older_kspipe_is_told_what_the_new_rule_asks():
    """init_from= asks starts_from=True since 0.2.0: the line says so, and what to declare."""
    from omegaconf import OmegaConf

    from kspipe.pipeline import check_declared

    with pytest.raises(ConfigError) as refused:
        check_declared(OmegaConf.create({"init_from": "/runs/a"}), Workload("old", "", ""))
    assert str(refused.value) == (
        "init_from=/runs/a: the old workload does not declare starts_from=True, which kspipe "
        "asks since 0.2.0 of a workload given init_from= (CHANGELOG.md); a plugin built for "
        "an older kspipe declares Workload(starts_from=True) if its execute stage calls "
        "kspipe.api.start_from"
    )


def test_a_workload_that_resumes_is_given_resume_and_restarts(tmp_path):
    workload = checked(
        tmp_path, "stages.program=goes_on", f"resume={tmp_path}", "cluster.max_restarts=3"
    )
    assert workload == Workload(name="goes_on", headline="loss", rate="steps_per_s", resumes=True)


def test_a_requeued_slurm_job_of_a_workload_that_resumes_resumes(tmp_path, monkeypatch):
    """Slurm's requeue sets ``resume`` itself (pipeline.prepare), before the check."""
    newest = tmp_path / "run" / "checkpoints" / "checkpoint-0000008"
    newest.mkdir(parents=True)
    (newest.parent / "checkpoint-0000004").mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    pm = plugin_manager(("goes_on", Declared("goes_on", True)))
    cfg = compose_config(
        [f"run_dir={tmp_path / 'run'}", "stages.program=goes_on", "cluster.launcher=slurm"]
    )
    assert prepare(cfg, pm).resumes
    assert cfg.resume == str(newest)


def test_the_shipped_workloads_that_read_resume_declare_it():
    """Reptile and ctr read ``cfg.resume`` in their execute stage (the example classifier,
    which reads no checkpoint, is refused by the test below)."""
    from kspipe.ctr import plugin as ctr
    from kspipe.reptile import plugin as reptile

    assert reptile.kspipe_describe_workload(cfg=None).resumes
    assert ctr.kspipe_describe_workload(cfg=None).resumes


def test_the_classifier_refuses_resume_and_restarts_before_any_process_starts(tmp_path):
    """Through the command: one line, no traceback, nothing started (the run folder holds
    Hydra's files only)."""
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, CLASSIFIER, "classifier = kspipe_classifier.plugin")
    common = ["+experiment=blobs", "tracking.enabled=false"]
    for name, given, line in (
        (
            "resumed",
            [f"resume={tmp_path}"],
            f"resume={tmp_path}: the classifier workload does not declare resumes=True, "
            f"which kspipe asks since 0.2.0 of a workload given resume= (CHANGELOG.md); a "
            f"plugin built for an older kspipe declares Workload(resumes=True) if its "
            f"execute stage loads the checkpoint resume= names (kspipe.api.load_checkpoint)",
        ),
        (
            "restarted",
            ["mode=pserver", "workers=2", "cluster.max_restarts=1"],
            "cluster.max_restarts=1: the classifier workload does not declare "
            "resumes=True, which kspipe asks since 0.2.0 of a workload a restart resumes "
            "(CHANGELOG.md); a plugin built for an older kspipe declares "
            "Workload(resumes=True) if its execute stage loads the checkpoint resume= "
            "names (kspipe.api.load_checkpoint); else set cluster.max_restarts=0 (it "
            "would start over from nothing)",
        ),
    ):
        run_dir = tmp_path / name
        result = run_kspipe(
            *common, *given, f"run_dir={run_dir}", cwd=tmp_path, env=plugin_env(site), timeout=120
        )
        assert_one_line_error(result)
        assert result.stderr.strip().splitlines() == [f"kspipe: error: {line}"], result.stderr
        assert sorted(p.name for p in run_dir.iterdir()) == [".hydra"]
