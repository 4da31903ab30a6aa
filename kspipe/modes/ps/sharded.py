"""A sync round's sum split between the workers' chain and shard summers beside the
servers, so the servers' links, idle in a sync round, carry part of its bytes.

The round's array (W bytes, N workers, M servers, each on a host of its own) is split in
two: its first fraction f is summed along the workers' chain
(:class:`kspipe.modes.summing.WorkerSum`), the rest in M slices, slice s by the shard
summer beside server s (:mod:`kspipe.modes.ps.summer`), which takes it from every worker
and sends the total slice back to each.  Both add every element in worker order, so the
result is the chain's alone bit for bit.

Bytes each way on a host's link per round:

* the chain's part: a middle worker passes it on both ways, 2 f W; an end worker
  (worker 0 and N - 1) f W;
* the shards' part: a worker (1 - f) W, a server N (1 - f) W / M.

So a middle worker carries (1 + f) W, an end worker W whatever f, a server
r (1 - f) W with r = N / M.  From N >= 3 the busiest link (the chain alone: 2 W) is
lowest where a middle worker's and a server's balance:
``f = (r - 1) / (r + 1)``, clipped to [0, 1], giving 2 r / (r + 1) W (r >= 1; W when
r <= 1, all on the summers).  16 workers and 8 servers: f = 1/3, 4/3 W instead of 2 W.
At N = 2 both workers are chain ends, whose link carries W whatever f: splitting cannot
lower the busiest link, so the chain alone sums (f = 1), as it does for N = 1.

A worker learns each summer's port from the job's gloo meeting point (kspipe's address
book, ``PADDLE_GLOO_RENDEZVOUS=3``), where the server puts it; a job meeting in a folder
(``=2``) sums along the chain alone.  Servers and workers decide alike from what both know
(N, M, the array's size, the environment), with no word between them.
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time

import numpy as np

from kspipe.cluster import secret
from kspipe.errors import ClusterError
from kspipe.modes import summing
from kspipe.modes.ps import summer

#: Where server s's summer's port is kept in the meeting point's address book: under the
#: job's token, as gloo's keys (the book answers no other path).
BOOK_KEY = "/{token}_summer/{server}"
#: How long a worker waits for a server's summer to be announced, and to connect to it.
FIND_TIMEOUT_S = 300.0
POLL_S = 0.02
#: The sum's dtype in the parameter servers' rounds.
DTYPE = "float64"


def chain_fraction(workers: int, servers: int) -> float:
    """The share f of the array the chain sums (the module's docstring derives it)."""
    if workers < 3:
        return 1.0
    ratio = workers / servers
    return min(1.0, max(0.0, (ratio - 1) / (ratio + 1)))


def split(size: int, workers: int, servers: int) -> tuple:
    """``(chain_end, [(start, end) of each server's slice])``: the chain sums
    ``[0, chain_end)``, server s's summer its slice of the rest (as even as can be)."""
    fraction = chain_fraction(workers, servers)
    chain_end = size if fraction >= 1.0 else int(round(fraction * size))
    per, longer = divmod(size - chain_end, servers)
    slices, at = [], chain_end
    for s in range(servers):
        length = per + (s < longer)
        slices.append((at, at + length))
        at += length
    return chain_end, slices


def meeting_book(env=os.environ) -> str | None:
    """``host:port`` of the job's address book, where summers are announced; None where
    the job meets otherwise."""
    if env.get("PADDLE_GLOO_RENDEZVOUS") == "3":
        return env.get("PADDLE_GLOO_HTTP_ENDPOINT") or None
    return None


def splits(role, size: int) -> bool:
    """Whether this job's rounds of ``size`` values use shard summers."""
    servers = len(role.get_pserver_endpoints())
    chain_end, _ = split(size, role.worker_num(), servers)
    return chain_end < size and meeting_book() is not None


def start_summer(role, size: int, dtype: str = DTYPE, chunk_bytes: int = summer.CHUNK_BYTES):
    """A server, before it serves: start its summer for rounds of ``size`` values, if the
    job's rounds use them and its slice holds any, and announce its port.  Returns the
    summer's process (keep it: the summer ends when it is dropped, or the server ends)."""
    if not splits(role, size):
        return None
    endpoints, index = role.get_pserver_endpoints(), role.server_index()
    start, end = split(size, role.worker_num(), len(endpoints))[1][index]
    if end == start:
        return None
    host = endpoints[index].rpartition(":")[0]
    listener = socket.create_server((host, 0), backlog=max(8, role.worker_num()))
    port = listener.getsockname()[1]
    process = summer.launch(listener, role.worker_num(), end - start, dtype, chunk_bytes)
    put(meeting_book(), book_key(index), str(port))
    print(
        f"server {index}: its shard summer sums values [{start}, {end}) of the "
        f"{role.worker_num()} workers' rounds at {host}:{port}",
        flush=True,
    )
    return process


def worker_sum(role, size: int, shard: bool = True, dtype: str = DTYPE):
    """A worker's sum of rounds of ``size`` values: shared with the servers' summers where
    they lower the busiest link's bytes (and ``shard``), else the chain alone."""
    if shard and splits(role, size):
        return ShardedSum(role, size, dtype)
    return summing.WorkerSum(role)


class ShardedSum:
    """``sum(array)`` over every worker: the chain's part and the summers' slices at once."""

    def __init__(self, role, size: int, dtype: str = DTYPE):
        self.size, self.dtype = size, np.dtype(dtype)
        self.index = role.worker_index()
        endpoints = role.get_pserver_endpoints()
        self.chain_end, slices = split(size, role.worker_num(), len(endpoints))
        self.chain = summing.WorkerSum(role) if self.chain_end else None
        self.links: list = []  # [(server, link, start, end)]
        try:
            for server, (start, end) in enumerate(slices):
                if end > start:
                    link = connect(endpoints[server], server, self.index)
                    self.links.append((server, link, start, end))
        except BaseException:
            self.close()
            raise

    def sum(self, values: np.ndarray) -> np.ndarray:
        """Every worker's ``values`` (``size`` values of the dtype, the same shape on every
        worker) summed in worker order, in that dtype."""
        values = np.ascontiguousarray(values)
        own = values.reshape(-1)
        if own.size != self.size or own.dtype != self.dtype:
            raise ValueError(f"a round of {self.size} {self.dtype}, not {own.size} {own.dtype}")
        total = np.empty_like(own)
        moves = []
        for server, link, start, end in self.links:  # to and from each summer at once
            moves.append(Move(server, link.sendall, memoryview(own[start:end]).cast("B")))
            moves.append(Move(server, summing.receive_into, link, total[start:end]))
        try:
            if self.chain is not None:
                total[: self.chain_end] = self.chain.sum(own[: self.chain_end])
            for move in moves:
                move.join()
        except BaseException:
            self.close()  # wakes the moves still blocked on a link
            for move in moves:
                move.join(quietly=True)
            raise
        return total.reshape(values.shape)

    def close(self) -> None:
        """Shut and close every link (a shut link wakes a thread blocked on it)."""
        if self.chain is not None:
            self.chain.close()
        summer.end_links([link for _, link, _, _ in self.links])
        self.links = []


class Move(threading.Thread):
    """One direction of one summer's link in a round, on a thread of its own."""

    def __init__(self, server: int, work, *args):
        super().__init__(daemon=True)
        self.server, self.work, self.args = server, work, args
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.work(*self.args)
        except BaseException as err:  # noqa: BLE001 - raised again on the round's thread
            self.error = err

    def join(self, timeout: float | None = None, quietly: bool = False) -> None:
        super().join(timeout)
        if self.error is not None and not quietly:
            raise ClusterError(
                f"server {self.server}'s shard summer ended in the middle of a sync round "
                f"(a worker or the server left the job)"
            ) from self.error


def connect(endpoint: str, server: int, index: int) -> socket.socket:
    """This worker's link to server ``server``'s summer (its port from the address book)."""
    port = int(look_up(meeting_book(), book_key(server)))
    host = endpoint.rpartition(":")[0]
    if not 0 < port < 65536:
        raise ClusterError(f"server {server}'s shard summer was announced at port {port}")
    try:
        link = summer.greet((host, port), index, FIND_TIMEOUT_S)
        link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError as err:
        raise ClusterError(
            f"worker {index} cannot reach server {server}'s shard summer at {host}:{port}: "
            f"{err.strerror or err}"
        ) from err
    return link


def book_key(server: int) -> str:
    return BOOK_KEY.format(token=secret.token("gloo"), server=server)


def put(book: str, key: str, value: str) -> None:
    host, _, port = book.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("PUT", key, body=value.encode())
        status = connection.getresponse().status
    except OSError as err:
        raise ClusterError(f"the job's meeting point {book} did not take {key}: {err}") from err
    finally:
        connection.close()
    if status != 200:
        raise ClusterError(f"the job's meeting point {book} refused {key} (HTTP {status})")


def look_up(book: str, key: str, timeout_s: float = FIND_TIMEOUT_S) -> str:
    """The value put at ``key`` in the address book, once it is there."""
    host, _, port = book.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            connection.request("GET", key)
            answer = connection.getresponse()
            if answer.status == 200:
                value = answer.read().decode()
                if value.isdigit():
                    return value
        except OSError:
            pass
        finally:
            connection.close()
        if time.monotonic() > deadline:
            raise ClusterError(f"{key} was not announced at {book} within {timeout_s:.0f} s")
        time.sleep(POLL_S)
