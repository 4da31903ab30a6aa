"""A job that its scheduler starts again (Slurm's requeue, a PaddleJob's pod restarted):
the checkpoint it resumes from, and the one MLflow run all its attempts record into.  The
whole of it, on a real Slurm: tests/modes/test_slurm.py."""

import shutil

import pytest
from omegaconf import OmegaConf

from kspipe import job
from kspipe.testing.runs import begun_store


def config(**cluster) -> OmegaConf:
    return OmegaConf.create({"mode": "pserver", "resume": None, "cluster": cluster})


POD = {"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "0"}
TOKEN = {job.JOB_TOKEN_ENV: "f00d"}


@pytest.mark.parametrize(
    "cluster, env, expected",
    [
        ({"launcher": "slurm"}, {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2"}, ("slurm-7", 2)),
        ({"launcher": "slurm"}, {"SLURM_JOB_ID": "7"}, ("slurm-7", 0)),
        ({"launcher": "processes"}, {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}, None),
        ({"job_id": "bags"}, {**POD, **TOKEN}, ("paddlejob-bags-f00d", None)),
        (
            {},
            {**POD, "PADDLE_JOB_ID": "bags", **TOKEN},
            ("paddlejob-bags-f00d", None),
        ),
        ({"job_id": "bags"}, POD, None),  # a pod of a manifest kspipe did not write
        ({}, TOKEN, None),  # not a pod
    ],
)
def test_a_run_is_an_attempt_of_a_job_only_where_a_scheduler_may_start_it_again(
    cluster, env, expected
):
    found = job.attempt(config(**cluster), env)
    assert (found and (found.job, found.restarts)) == expected


def test_a_requeued_job_resumes_from_its_newest_complete_checkpoint_named_outright(tmp_path):
    for name in ("checkpoint-0000004", "checkpoint-0000008", "checkpoint-0000012.tmp"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    (tmp_path / "checkpoints" / "worker-1" / "checkpoint-0000012").mkdir(parents=True)
    requeued = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}
    slurm = config(launcher="slurm")
    assert job.requeued_checkpoint(slurm, str(tmp_path), requeued) == str(
        tmp_path / "checkpoints" / "checkpoint-0000008"
    )
    assert job.requeued_checkpoint(slurm, str(tmp_path), {"SLURM_JOB_ID": "7"}) is None
    assert job.requeued_checkpoint(slurm, str(tmp_path / "new"), requeued) is None
    assert job.requeued_checkpoint(config(launcher="processes"), str(tmp_path), requeued) is None


def test_a_run_resumed_from_its_own_last_checkpoint_keeps_it(tmp_path):
    """A job requeued after its training ended trains nothing more: the checkpoint it
    resumed from is not written again; one resumed from another run's is copied."""
    from kspipe.reptile.training import resumed_at

    for run in ("run", "other"):
        for step in (36, 40):
            folder = tmp_path / run / "checkpoints" / f"checkpoint-{step:07d}"
            folder.mkdir(parents=True)
            (folder / "progress.json").write_text("{}")
    own = str(tmp_path / "run" / "checkpoints")
    loaded = str(tmp_path / "run" / "checkpoints" / "checkpoint-0000040")  # the learner's
    assert resumed_at(loaded, own, 40)
    assert not resumed_at(loaded, own, 36)
    assert not resumed_at(str(tmp_path / "other" / "checkpoints" / "checkpoint-0000040"), own, 40)
    assert not resumed_at(None, own, 40)
    # it reads nothing: the checkpoint it resumed from may be pruned since
    shutil.rmtree(loaded)
    assert resumed_at(loaded, own, 40)


def attempt_of(tmp_path, job_key: str, restarts, resumed_from=None, run_dir="outputs/job-bags"):
    """A recorder's record of one attempt of ``job_key``, opened as the tracking plugin
    opens it; the record and its run's id."""
    from kspipe.observers.mlflow.record import Record

    config_path = tmp_path / "config.yaml"
    config_path.write_text("workers: 2\n")
    record = Record()
    run_id, _ = record.open(
        begun_store(tmp_path),
        "kspipe",
        None,
        {
            "run_name": "bags",
            "tags": {"kspipe.run_dir": str(tmp_path / run_dir), "kspipe.job": job_key},
            "params": [("workers", "2"), ("resume", str(resumed_from))],
            "config_path": str(config_path),
            "register": None,
            "alias": None,
            "source": None,
            "restart": {"restarts": restarts, "resumed_from": resumed_from},
        },
    )
    return record, run_id


def status_and_restarts(record, run_id) -> tuple:
    run = record.client.get_run(run_id)
    return run.info.status, run.data.tags.get("kspipe.restarts")


def test_a_restarted_pod_goes_on_in_its_jobs_run_and_a_new_job_gets_its_own(
    tmp_path, monkeypatch, capsys
):
    """Kubernetes counts no restarts: the job's run in the store tells that a pod of the
    same manifest (its token) is a restart, and how many came before."""
    monkeypatch.chdir(tmp_path)  # MLflow's artifact folder is relative to it
    first, run_id = attempt_of(tmp_path, "paddlejob-bags-f00d", None)
    first.metrics({"loss": 1.0}, 4, 1000)
    first.end("FAILED")
    assert status_and_restarts(first, run_id) == ("FAILED", "0")

    capsys.readouterr()
    for restarts, ended in ((1, "FAILED"), (2, "KILLED")):  # the pod restarted, twice
        again, same = attempt_of(tmp_path, "paddlejob-bags-f00d", None)
        assert same == run_id
        assert status_and_restarts(again, run_id) == ("RUNNING", str(restarts))
        assert capsys.readouterr().err == (
            f"kspipe: the job's MLflow run {run_id} goes on (restart {restarts}; it ended "
            f"{ended} before)\n"
        )
        again.metrics({"loss": 0.5}, 4 + restarts, 2000)
        again.end("KILLED" if restarts == 1 else "FINISHED")
    assert status_and_restarts(again, run_id) == ("FINISHED", "2")
    history = again.client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(4, 1.0), (5, 0.5), (6, 0.5)]

    # a new manifest of the same job name (its own token), in the same run folder
    new, other = attempt_of(tmp_path, "paddlejob-bags-beef", None)
    assert other != run_id and status_and_restarts(new, other) == ("RUNNING", "0")


def test_a_requeued_slurm_job_goes_on_in_its_run_and_a_new_job_never_takes_one(
    tmp_path, monkeypatch
):
    """Slurm counts its restarts: a first attempt (restart 0) always records a new run,
    even where a run of the same job key and run folder is there (job ids start again
    at 1 on a Slurm whose state was wiped); a requeue goes on in the newest of them, its
    params as the first attempt logged them."""
    monkeypatch.chdir(tmp_path)
    old, old_id = attempt_of(tmp_path, "slurm-7", 0)
    old.end("FINISHED")
    first, run_id = attempt_of(tmp_path, "slurm-7", 0)
    assert run_id != old_id
    first.end("KILLED")
    checkpoint = str(tmp_path / "outputs/job-bags/checkpoints/checkpoint-0000008")
    again, same = attempt_of(tmp_path, "slurm-7", 1, checkpoint)
    assert same == run_id
    run = again.client.get_run(run_id)
    assert run.data.tags["kspipe.resumed_from"] == checkpoint
    assert run.data.params["resume"] == "None"
    assert status_and_restarts(again, run_id) == ("RUNNING", "1")
    assert status_and_restarts(again, old_id) == ("FINISHED", "0")
    # another command of the same allocation (its own run folder) is a run of its own
    beside, elsewhere = attempt_of(tmp_path, "slurm-7", 1, run_dir="outputs/job-other")
    assert elsewhere not in (run_id, old_id)
    assert status_and_restarts(beside, elsewhere) == ("RUNNING", "1")


def points(record, run_id, key) -> list[tuple]:
    return sorted((m.step, m.value) for m in record.client.get_metric_history(run_id, key))


@pytest.mark.parametrize("how", ["requeued", "restarted worker"])
def test_a_resumed_attempt_logs_no_step_its_run_already_holds(tmp_path, monkeypatch, how):
    """Resumed from the checkpoint of step 5, the second attempt trains steps 6-10 again:
    the run keeps the first attempt's points there, one per step, and takes the new ones
    from step 11 on, and a metric the first attempt never logged whole.  A process's
    system metrics and the launcher's ``restarts`` count are logged as they come.  How the
    run is opened again: Slurm's requeue (:func:`~kspipe.observers.mlflow.earlier_runs.reopen`),
    or ``cluster.max_restarts`` starting the first worker again in the launcher's run (its
    id given)."""
    from kspipe.observers.mlflow.record import Record

    monkeypatch.chdir(tmp_path)
    owner, run_id = attempt_of(tmp_path, "slurm-7", 0)

    def attempt(restarts: int) -> Record:
        if how == "requeued":
            record, same = attempt_of(tmp_path, "slurm-7", restarts) if restarts else (owner, 0)
            assert same in (0, run_id)
            return record
        worker = Record()
        assert worker.open(begun_store(tmp_path), "kspipe", run_id, None)[0] == run_id
        return worker

    first = attempt(0)
    for step in range(1, 11):
        first.metrics({"loss": float(step), "system/cpu_percent": 50.0}, step, 1000 + step)
    first.metrics({"accuracy": 0.5, "restarts": 1.0}, 4, 2000)
    if how == "requeued":
        first.end("KILLED")

    again = attempt(1)
    for step in range(6, 16):
        again.metrics({"loss": 100.0 + step}, step, 3000 + step)
    again.metrics({"accuracy": 0.75, "system/cpu_percent": 60.0, "eval": 0.25}, 4, 4000)
    again.metrics({"accuracy": 0.875, "restarts": 1.0}, 5, 4001)
    again.metrics({"restarts": 1.0}, 4, 4002)  # a launcher requeued counts from 1 again

    assert points(again, run_id, "loss") == [(s, float(s)) for s in range(1, 11)] + [
        (s, 100.0 + s) for s in range(11, 16)
    ]
    assert points(again, run_id, "accuracy") == [(4, 0.5), (5, 0.875)]
    assert points(again, run_id, "eval") == [(4, 0.25)]
    assert points(again, run_id, "restarts") == [(4, 1.0), (4, 1.0), (5, 1.0)]
    assert points(again, run_id, "system/cpu_percent") == sorted(
        [(s, 50.0) for s in range(1, 11)] + [(4, 60.0)]
    )


def test_a_new_run_logs_every_point_it_is_given(tmp_path, monkeypatch):
    """No earlier attempt, nothing left out: a step logged twice within one attempt stays
    twice, as MLflow takes it."""
    monkeypatch.chdir(tmp_path)
    record, run_id = attempt_of(tmp_path, "slurm-7", 0)
    assert record.logged == {}
    for step, loss in ((1, 1.0), (2, 2.0), (2, 2.5), (3, 3.0)):
        record.metrics({"loss": loss}, step, 1000 + step)
    assert points(record, run_id, "loss") == [(1, 1.0), (2, 2.0), (2, 2.5), (3, 3.0)]
