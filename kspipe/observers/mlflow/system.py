"""A process's system metrics, sampled by its recorder process and logged into its run.

MLflow's :class:`~mlflow.system_metrics.system_metrics_monitor.SystemMetricsMonitor` samples
in a thread and logs through a client for a run id, so it runs in the recorder
(:mod:`kspipe.observers.mlflow.record`), beside the job's process it watches, on that
process's host: the job's process itself neither imports MLflow nor spends its time on it.
Each process of a job samples its own, under its node id (``worker0``, ``server1``; none for
a job of one process): ``system/worker0/cpu_utilization_percentage``...

MLflow's own monitors sample the whole machine, which on a host that runs several of a job's
processes gives every one of them the same line; so the CPU and memory here are the
process's own (:class:`ProcessMonitor`), beside its host's memory and network (psutil has
no network counters of a process; on one host they include the loopback traffic between
the job's processes).
"""

from __future__ import annotations

import logging
import time

import psutil

from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor
from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor


class ProcessMonitor(BaseMetricsMonitor):
    """The CPU and resident memory of the process ``pid`` (its threads, not its children:
    its recorder is one), and its host's memory.  The CPU is a share of the host's CPUs, as
    MLflow's host-wide ``cpu_utilization_percentage`` is (100: every core busy), since the
    sample before; the first one's since the process started (its sampler starts once the
    recorder has opened the store, seconds later)."""

    def __init__(self, pid: int):
        super().__init__()
        self.process = psutil.Process(pid)
        self.cpus = psutil.cpu_count() or 1
        self.busy, self.since = 0.0, self.process.create_time()  # CPU seconds, and when

    def collect_metrics(self) -> None:
        try:
            with self.process.oneshot():
                times = self.process.cpu_times()
                resident = self.process.memory_info().rss
        except psutil.Error:  # the process is gone: its last interval is not sampled
            return
        now, busy = time.time(), times.user + times.system
        if now > self.since:
            share = (busy - self.busy) / (now - self.since) / self.cpus
            self._metrics["cpu_utilization_percentage"].append(100 * share)
        self.busy, self.since = busy, now
        host = psutil.virtual_memory()
        self._metrics["process_memory_usage_megabytes"].append(resident / 1e6)
        self._metrics["process_memory_usage_percentage"].append(resident / host.total * 100)
        self._metrics["system_memory_usage_megabytes"].append(host.used / 1e6)
        self._metrics["system_memory_usage_percentage"].append(host.used / host.total * 100)

    def aggregate_metrics(self) -> dict:
        return {k: round(sum(v) / len(v), 1) for k, v in self._metrics.items() if v}


class Sampler(SystemMetricsMonitor):
    """MLflow's monitor of the run ``run_id`` in the store ``uri``, sampling the process
    ``pid`` every ``interval`` seconds under ``node_id``; :meth:`finish` also logs the
    interval the run ended in (MLflow's own drops it)."""

    def __init__(self, uri: str, run_id: str, pid: int, node_id: str | None, interval: float):
        # its notes, and its warnings of a store that does not answer: the recorder says that
        logging.getLogger("mlflow.system_metrics").setLevel(logging.ERROR)
        super().__init__(run_id, sampling_interval=interval, node_id=node_id, tracking_uri=uri)
        self.sampling_interval = interval  # the config's, over MLflow's variable
        self.node_id = node_id or self.node_id
        self.monitors = [ProcessMonitor(pid), NetworkMonitor()]

    def finish(self) -> None:
        running = self._process is not None
        super().finish()
        if running:
            self.collect_metrics()
            self.publish_metrics(self.aggregate_metrics())
            self.mlflow_logger.flush()
