"""A job too large for where it runs is refused before anything starts: more processes
than this host can hold (:func:`check_host`), or more workers than its workload has steps
to share (:func:`check_work`).  The ``kspipe`` command asks both before the run folder,
the MLflow run or any process exists (:func:`kspipe.cli.checks.check_job_size`).

What a process needs was measured once, as :data:`WORKER_MIB`, :data:`SERVER_MIB` and
:data:`PROCESSES_PER_CORE` say; what the host has is psutil's (the memory available now,
the cores).  Only the processes this host's launcher starts count: a job whose endpoint
lists name several hosts counts this host's (``cluster.host``), each host of an emulated
network its own.
"""

from __future__ import annotations

from kspipe.cluster.endpoints import parse_endpoints, this_host
from kspipe.errors import ConfigError

#: Peak memory of one worker process, in MiB: its proportional set size (PSS: the shared
#: libraries, Paddle's ~250 MB, counted once across the job's processes), measured with
#: psutil every 0.2 s over a Reptile ``omniglot_5way`` job (``mode=pserver workers=4
#: servers=2 cluster.strategy=sync train.meta_iters=40``, 2-core AMD EPYC, 2026-12-07):
#: the first worker 432 MiB (it evaluates), the others 369-409 MiB; a collective worker
#: alike.  (Their RSS, which counts the shared libraries in each: 508-576 MiB.)
WORKER_MIB = 440

#: Peak memory of one parameter server and its shard summer, in MiB, measured in the same
#: job: the server 174 MiB, its summer 19 MiB (RSS 296 and 34 MiB).
SERVER_MIB = 200

#: At most this many of a job's processes a core.  A worker's start-up alone (Python,
#: Paddle, its programs) costs 2.6-3.1 CPU seconds (measured in the same job), so at 16 a
#: core the cores are busy ~48 s before the first step, and each process then gets a
#: sixteenth of a core; above that a job spends its time starting and switching (the
#: 500 collective workers of issue 47 had 126 processes up after 4 minutes on 2 cores, load
#: average 133).  16 a core keeps what runs on one host today: ``bench/scale_checks.py``'s
#: loopback job (8 workers and 4 servers on 2 cores; 16 and 8 fit too).
PROCESSES_PER_CORE = 16

GIB = 1024**3
MIB = 1024**2


def processes_here(cfg) -> tuple[int, int]:
    """``(workers, servers)`` that this host's launcher would start for ``cfg``: a count
    is all here; a ``host:port`` list counts the endpoints on this host.  ``(0, 0)`` for
    a mode kspipe does not know the processes of (``local`` runs this one)."""
    if cfg.get("mode") not in ("pserver", "collective"):
        return 0, 0
    given = {"workers": cfg.workers, "servers": cfg.servers if cfg.mode == "pserver" else 0}
    listed = {key: parse_endpoints(value, key) for key, value in given.items() if value}
    everyone = [endpoint for endpoints in listed.values() for endpoint in endpoints or ()]
    here = this_host(cfg.cluster.get("host"), everyone) if everyone else None

    def count(key: str) -> int:
        if listed.get(key) is None:
            return int(given[key] or 0)
        return sum(1 for e in listed[key] if e.rpartition(":")[0] == here)

    return count("workers"), count("servers")


def host_refusal(workers: int, servers: int, available: int, cores: int) -> str:
    """Why ``workers`` and ``servers`` processes do not fit a host of ``available`` bytes of
    memory and ``cores`` cores ('' where they do): what they would need, what it has."""
    processes = workers + servers
    memory = (workers * WORKER_MIB + servers * SERVER_MIB) * MIB
    if memory <= available and processes <= PROCESSES_PER_CORE * cores:
        return ""
    each = f"{WORKER_MIB} MiB a worker" + (
        f", {SERVER_MIB} MiB a server and its summer" if servers else ""
    )
    needed_cores = -(-processes // PROCESSES_PER_CORE)
    return (
        f"its {processes} processes would need {memory / GIB:.1f} GiB of memory ({each}, "
        f"measured) and {needed_cores} cores (at most {PROCESSES_PER_CORE} processes a "
        f"core); this host has {available / GIB:.1f} GiB available and {cores} cores"
    )


def check_host(cfg, available: int | None = None, cores: int | None = None) -> None:
    """A :class:`ConfigError` in one line where the processes this host would start for
    ``cfg`` need more memory than it has available, or more cores (:data:`PROCESSES_PER_CORE`
    a core).  ``available`` (bytes) and ``cores`` are psutil's unless given."""
    import psutil

    workers, servers = processes_here(cfg)
    if workers + servers <= 1:
        return
    available = psutil.virtual_memory().available if available is None else available
    cores = (psutil.cpu_count() or 1) if cores is None else cores
    refusal = host_refusal(workers, servers, available, cores)
    if refusal:
        asked = f"mode={cfg.mode} workers={cfg.workers}" + (
            f" servers={cfg.servers}" if servers else ""
        )
        raise ConfigError(
            f"{asked} is too large for this host: {refusal} (fewer processes, or the job "
            f"spread over hosts: host:port lists, cluster.launcher=slurm)"
        )


def check_work(cfg, workload) -> None:
    """A :class:`ConfigError` in one line where ``cfg`` asks for more workers than the
    ``workload`` has steps to share (:attr:`kspipe.contracts.Workload.steps`): a worker
    would get none."""
    if cfg.get("mode") not in ("pserver", "collective") or not workload.steps:
        return
    listed = parse_endpoints(cfg.workers, "workers")
    workers = len(listed) if listed is not None else int(cfg.workers)
    if workers > workload.steps:
        setting = f" ({workload.steps_key}={workload.steps})" if workload.steps_key else ""
        raise ConfigError(
            f"workers={cfg.workers}: the {workload.name} workload has {workload.steps} "
            f"steps to share among its workers{setting}, so {workers - workload.steps} "
            f"of the {workers} would get none: at most {workload.steps} workers"
        )
