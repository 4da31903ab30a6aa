"""A job handed to a scheduler: what the command says as it hands it off."""

import pytest

from kspipe.testing import compose_config


@pytest.mark.parametrize(
    "given, lost",
    [
        ([], ["SQLite store (tracking.uri=sqlite:///mlflow.db)", "run folder (outputs/job-"]),
        (["run_dir=/shared/run"], ["SQLite store (tracking.uri=sqlite:///mlflow.db)"]),
        (["tracking.uri=http://mlflow:5000"], ["run folder (outputs/job-"]),
        (["tracking.uri=sqlite:////shared/mlflow.db", "run_dir=/shared/run"], []),
        (["tracking.enabled=false", "run_dir=/shared/run"], []),
    ],
)
def test_a_paddlejob_without_shared_storage_says_where_its_results_would_be_lost(
    tmp_path, capsys, given, lost
):
    """Each pod keeps a relative store and run folder in its own working folder, which
    Kubernetes deletes with the pod: one warning line names what would be lost, and the
    manifest is written all the same."""
    from kspipe.launchers.kubernetes import PaddleJobLauncher

    overrides = ["mode=pserver", "cluster.launcher=paddlejob", "cluster.image=kspipe:1", *given]
    cfg = compose_config(["+experiment=omniglot_5way", *overrides, f"run_dir={tmp_path}"])
    handed = PaddleJobLauncher().hand_off(cfg, overrides)
    assert "kubectl apply" in handed and (tmp_path / "paddlejob.yaml").is_file()
    said = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    if not lost:
        assert said == []
        return
    (line,) = said
    assert line.startswith("kspipe: warning: the PaddleJob's results would be lost")
    assert "cleanPodPolicy: OnCompletion" in line
    for what in lost:
        assert what in line, line
    assert ("tracking.uri=<a tracking server>" in line) == ("tracking.uri=sqlite:///" in line)
