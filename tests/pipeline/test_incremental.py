"""Incremental training: ``init_from=<run>`` starts a new run from a finished run's model, in
any mode: trained on a parameter-server cluster, continued in one process, and back.  Its
first evaluation (the baseline) is the source's final one, on the same test tasks.  (ctr,
whose tables the servers keep as sparse tables: workloads/test_ctr.py.)"""

import json
import shutil

import pytest

from kspipe.errors import ConfigError
from kspipe.pipeline import run
from kspipe.testing import (
    assert_one_line_error,
    compose_config,
    plugin_manager,
    run_kspipe,
    tiny_overrides,
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
