"""A job too large is refused before anything starts, in one line saying what it would
need and what the host has (kspipe/config/size.py): more processes than this host holds
(memory measured per process, processes a core), or more workers than its workload has
steps to share.  Only this host's processes count in a job across hosts."""

import psutil
import pytest
from omegaconf import OmegaConf

from kspipe.config import size
from kspipe.contracts import Workload
from kspipe.errors import ConfigError
from kspipe.testing import assert_one_line_error, begun_store, run_kspipe, run_statuses

GIB = 1024**3


def refused_before_anything(tmp_path, *args):
    """``kspipe <args>`` in ``tmp_path``: its one error line, once checked that it made no
    run folder and recorded no MLflow run."""
    store = begun_store(tmp_path / "store")
    result = run_kspipe(
        "+experiment=omniglot_5way", f"tracking.uri={store}", *args, cwd=tmp_path, timeout=120
    )
    assert_one_line_error(result)
    assert "starting" not in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # no outputs/
    assert run_statuses(tmp_path / "store" / "mlflow.db") == []
    return next(line for line in result.stderr.splitlines() if line.startswith("kspipe: error:"))


def holds_500_workers() -> bool:
    return not size.host_refusal(500, 0, psutil.virtual_memory().available, psutil.cpu_count())


@pytest.mark.skipif(holds_500_workers(), reason="this host holds 500 workers")
def test_five_hundred_collective_workers_are_refused_on_this_host(tmp_path):
    """The job of issue 47 (2 cores, 24 GiB) started 126 processes in 4 minutes."""
    cores = psutil.cpu_count()
    line = refused_before_anything(tmp_path, "mode=collective", "workers=500")
    assert line.startswith(
        "kspipe: error: mode=collective workers=500 is too large for this host: its 500 "
        "processes would need 214.8 GiB of memory (440 MiB a worker, measured) and 32 cores "
        "(at most 16 processes a core); this host has "
    ), line
    assert f" GiB available and {cores} cores (" in line


def test_more_workers_than_meta_iterations_are_refused(tmp_path):
    line = refused_before_anything(
        tmp_path, "mode=pserver", "workers=3", "servers=1", "train.meta_iters=2"
    )
    assert line == (
        "kspipe: error: workers=3: the reptile workload has 2 steps to share among its "
        "workers (train.meta_iters=2), so 1 of the 3 would get none: at most 2 workers"
    )


def job(**given):
    return OmegaConf.create({"mode": "pserver", "workers": 1, "servers": 1, "cluster": {}} | given)


@pytest.mark.parametrize(
    "given, here",
    [
        ({"mode": "collective", "workers": 500}, (500, 0)),
        ({"workers": 16, "servers": 8}, (16, 8)),
        ({"mode": "local", "workers": 500}, (0, 0)),  # one process: workers is ignored
        (
            {
                "workers": [f"10.0.0.{i % 4 + 1}:70{i:02d}" for i in range(16)],
                "servers": [f"10.0.0.{i + 1}:7100" for i in range(4)],
                "cluster": {"host": "10.0.0.2"},
            },
            (4, 1),
        ),
        ({"workers": ["10.0.0.2:7000", "10.0.0.2:7001"], "servers": 2}, (2, 2)),
    ],
    ids=["collective", "pserver", "local", "across-hosts", "list-and-count"],
)
def test_only_this_hosts_processes_count(given, here):
    assert size.processes_here(job(**given)) == here


def test_the_rule_memory_measured_per_process_and_processes_a_core():
    """16 workers and 8 servers (bench/scale_checks.py's largest loopback job) fit 2 cores
    and 12 GiB; a process more than 16 a core, or more memory than available, does not."""
    assert size.host_refusal(16, 8, 12 * GIB, 2) == ""
    assert size.host_refusal(32, 0, 15 * GIB, 2) == ""
    assert size.host_refusal(33, 0, 15 * GIB, 2) == (
        "its 33 processes would need 14.2 GiB of memory (440 MiB a worker, measured) and 3 "
        "cores (at most 16 processes a core); this host has 15.0 GiB available and 2 cores"
    )
    assert "this host has 4.0 GiB available and 8 cores" in size.host_refusal(8, 4, 4 * GIB, 8)
    with pytest.raises(ConfigError, match=r"^mode=pserver workers=20 servers=20 is too large"):
        size.check_host(job(workers=20, servers=20), available=64 * GIB, cores=2)
    size.check_host(job(workers=20, servers=12), available=64 * GIB, cores=2)


def test_a_workload_that_says_its_steps_refuses_workers_with_none():
    reptile = Workload("reptile", "", "", steps=40, steps_key="train.meta_iters")
    size.check_work(job(workers=40), reptile)
    size.check_work(job(mode="local", workers=500), reptile)  # one process
    size.check_work(job(workers=500), Workload("bags", "", ""))  # says nothing
    with pytest.raises(ConfigError, match=r"^workers=41: .* so 1 of the 41 would get none"):
        size.check_work(job(workers=41), reptile)
