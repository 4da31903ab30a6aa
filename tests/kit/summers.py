"""A job's workers and servers for the sums shared with shard summers
(kspipe.modes.ps.sharded, kspipe.modes.ps.summer): their roles, a summer started as a
server starts it, workers greeting it, and one round through it."""

from __future__ import annotations

import socket
import threading

import numpy as np

from kspipe.cluster import greetings, secret
from kspipe.modes import summing
from kspipe.modes.ps import sharded, summer
from tests.kit.workers import Workers, in_worker_order


class Job(Workers):
    """``count`` workers' and ``servers`` servers' roles; the job's address book."""

    def __init__(self, count: int, servers: int):
        super().__init__(count)
        self.servers = [f"127.0.0.1:{8000 + s}" for s in range(servers)]

    def role(self, index: int, server: int = -1):
        role = super().role(index)
        role.get_pserver_endpoints = lambda: list(self.servers)
        role.server_index = lambda: server
        role.worker_num = lambda: self.count
        return role


def start_servers(job: Job, size: int, summers: list, dtype="float64", chunk_bytes=None):
    for s in range(len(job.servers)):
        kwargs = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
        summers.append(sharded.start_summer(job.role(-1, s), size, dtype, **kwargs))


def a_summer(summers: list, workers: int, size: int, chunk_bytes: int = summer.CHUNK_BYTES):
    """A summer started as a server starts it (in ``summers``); its listener's address, once
    it greets (a connection that goes away at once: one line in its log)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    address = listener.getsockname()
    summers.append(summer.launch(listener, workers, size, "float64", chunk_bytes))
    with socket.create_connection(address, timeout=60) as probe:
        greetings.receive(probe, secret.NONCE_BYTES)
    return address


def greeted(address: tuple, workers, timeout_s: float = 30.0) -> dict:
    """Each of ``workers`` greeting the summer at ``address`` at once (a thread each), as
    each worker's process does: their links."""
    links: dict = {}

    def greet(w: int) -> None:
        links[w] = summer.greet(address, w, timeout_s)
        links[w].settimeout(timeout_s)

    threads = [threading.Thread(target=greet, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    return links


def round_trip(links: dict, size: int) -> np.ndarray:
    """One round: each worker's slice sent, each worker's totals received and checked."""
    arrays = [np.full(size, 10.0 ** (8 * w)) + np.arange(size) / 3 for w in range(len(links))]
    for w in sorted(links):  # each worker's slice; the totals wait in each link
        links[w].sendall(arrays[w].tobytes())
    for w in sorted(links):
        total = np.empty(size)
        summing.receive_into(links[w], total)
        np.testing.assert_array_equal(total, in_worker_order(arrays))
