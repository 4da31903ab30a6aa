"""A sum of the workers' arrays in worker order, along a chain of TCP links, with no hub.

The parameter servers' sync and geo rounds sum every worker's change (float64) each step,
and a collective job on CPU its workers' fused gradients (kspipe/modes/fused.py).  Fleet's
gloo collectives take Python lists (``fleet.util.all_reduce`` converts every element both
ways and meets at a barrier first): 18 of a 22 ms step for 112,451 parameters; gloo's own
all-gather of a few hundred floats took 1.1 ms a step on CPU.

Here the workers form a chain, worker ``i`` linked to ``i + 1`` (each listens on its own
endpoint's address, announced once through the role's ``all_gather``).  A round moves the
array a chunk at a time, pipelined: going up the chain, worker ``i`` adds its chunk to the
partial sum of the workers before it and passes it on, so the last worker holds
``((v0 + v1) + v2) + ...``,
the workers' values added in worker order (the same bit for bit on every run, and what a
hub adding them in that order gives); coming back down, each passes the total on.  Every
link carries the array once each way whatever the number of workers, where a hub's own
link carries it once each way per other worker: the round's time grows with the chain's
length by a chunk per hop, not by a whole array per worker (BENCHMARKS.md).

Both ends know how many bytes a round moves (the array's size, the same on every worker),
so nothing a peer sends is read as a length; a link is taken only from the worker before
in the chain, which names itself first with a tag of the job's secret
(:mod:`kspipe.cluster.secret`): a fixed-length greeting, read from every connection at once
with a short deadline, so a stranger that sends nothing, garbage or a wrong tag is closed
(one line in the log) while the worker before still gets in.  Once the chain is made the
listener is closed: nobody connects mid-job.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time

import numpy as np

from kspipe.cluster import secret
from kspipe.errors import ClusterError

HELLO = struct.Struct(f"!Q{secret.TAG_BYTES}s")  # the connecting worker's index; its tag
#: How much a round moves at a time: small enough that the chain's later links start
#: early (the pipeline fills in a chunk per hop), large enough that Python's overhead per
#: chunk is small beside moving it.
CHUNK_BYTES = 1 << 16
ACCEPT_TIMEOUT_S = 300.0
#: How long a connection has to greet, and how many may be greeting at once (the oldest
#: beyond that is closed): strangers cannot hold the worker before out.
GREETING_TIMEOUT_S = 10.0
GREETING_PEERS = 32
WHAT = "the sum's chain"


class WorkerSum:
    """``sum(array)`` over every worker of ``role`` (each calls it, in step)."""

    def __init__(self, role):
        self.index, self.count = role.worker_index(), role.worker_num()
        self.previous: socket.socket | None = None  # the link to worker index - 1
        self.next: socket.socket | None = None  # the link to worker index + 1
        endpoints = role.get_trainer_endpoints()
        listener, port = None, 0
        if self.index > 0:
            host = endpoints[self.index].rsplit(":", 1)[0]
            listener = socket.create_server((host, 0), backlog=GREETING_PEERS)
            port = listener.getsockname()[1]
        ports = [int(p) for p in role.all_gather(port)]
        if self.count == 1:
            return
        if self.index + 1 < self.count:
            host = endpoints[self.index + 1].rsplit(":", 1)[0]
            self.next = socket.create_connection((host, ports[self.index + 1]))
            self.next.sendall(hello(self.index))
            _quick(self.next)
        if listener is not None:
            with listener:
                self.previous = accept_from(listener, self.index - 1)

    def sum(self, values: np.ndarray) -> np.ndarray:
        """Every worker's ``values`` (of one float dtype and shape on every worker) summed in
        worker order, in that dtype."""
        values = np.ascontiguousarray(values)
        if self.count == 1:
            return values.copy()
        own = values.reshape(-1)
        up, total = np.empty_like(own), np.empty_like(own)  # the partial sums; the total
        step = max(1, CHUNK_BYTES // own.itemsize)
        chunks = [(at, min(at + step, own.size)) for at in range(0, own.size, step)]
        down = None
        if self.next is not None and len(chunks) > 1:  # the totals come down at once, on a
            down = Passing(self.next, self.previous, total, chunks)  # thread of their own
        try:
            for start, end in chunks:  # up the chain: the partial sums
                if self.previous is None:
                    up[start:end] = own[start:end]
                else:
                    receive_into(self.previous, up[start:end])
                    np.add(up[start:end], own[start:end], out=up[start:end])
                if self.next is not None:
                    self.next.sendall(memoryview(up[start:end]).cast("B"))
                else:  # the last worker: this chunk's total, passed down at once
                    total[start:end] = up[start:end]
                    self.previous.sendall(memoryview(total[start:end]).cast("B"))
            if self.next is not None and down is None:  # one chunk: no thread to start
                receive_into(self.next, total)
                if self.previous is not None:
                    self.previous.sendall(memoryview(total).cast("B"))
            if down is not None:
                down.join()  # its error, if a link failed on its side
        except BaseException:
            self.close()  # a round left half-way: the links are no good any more, and the
            if down is not None:  # workers beside this one learn it as their links close
                down.join(quietly=True)  # it ends as its link shuts
            raise
        return total.reshape(values.shape)

    def close(self) -> None:
        """Shut and close both links: a shut link also wakes a thread of this process
        blocked on it (closing alone does not, on Linux)."""
        for link in (self.previous, self.next):
            if link is not None:
                try:
                    link.shutdown(socket.SHUT_RDWR)
                except OSError:  # the peer has gone already
                    pass
                link.close()
        self.previous = self.next = None


class Passing(threading.Thread):
    """Down the chain: each chunk of the total, received from the next worker, written
    into ``total`` and passed on to the previous one (if any), while the round's partial
    sums still go up; both directions of a link are busy at once."""

    def __init__(
        self, source: socket.socket, sink: socket.socket | None, total: np.ndarray, chunks: list
    ):
        super().__init__(daemon=True)
        self.source, self.sink, self.total, self.chunks = source, sink, total, chunks
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            for start, end in self.chunks:
                receive_into(self.source, self.total[start:end])
                if self.sink is not None:
                    self.sink.sendall(memoryview(self.total[start:end]).cast("B"))
        except BaseException as err:  # noqa: BLE001 - raised again on the round's thread
            self.error = err

    def join(self, timeout: float | None = None, quietly: bool = False) -> None:
        super().join(timeout)
        if self.error is not None and not quietly:
            raise self.error


def hello(index: int) -> bytes:
    """What worker ``index`` sends first on its link to the next worker."""
    return HELLO.pack(index, secret.tag("chain", str(index)))


def accept_from(listener: socket.socket, index: int) -> socket.socket:
    """The first connection to ``listener`` that greets as worker ``index`` with the job's
    tag; every other is closed once it has sent a greeting's length or its time is up."""
    expected = hello(index)
    deadline = time.monotonic() + ACCEPT_TIMEOUT_S
    listener.setblocking(False)
    waiting: dict = {}  # a connection -> [its address, what it sent, its deadline]
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        try:
            while True:
                now = time.monotonic()
                if now > deadline:
                    raise ClusterError(
                        f"worker {index} did not join the sync chain within "
                        f"{ACCEPT_TIMEOUT_S:.0f} s"
                    )
                for peer, (_, _, until) in list(waiting.items()):
                    if now > until:
                        _drop(selector, waiting, peer, "no greeting in time")
                ready = selector.select(min(1.0, deadline - now))
                for key, _ in ready:
                    if key.fileobj is listener:
                        _take(listener, selector, waiting)
                        continue
                    peer = key.fileobj
                    got = waiting[peer][1]
                    try:
                        part = peer.recv(HELLO.size - len(got))
                    except OSError:
                        part = b""
                    if not part:
                        _drop(selector, waiting, peer, "closed before greeting")
                        continue
                    got += part
                    waiting[peer][1] = got
                    if len(got) < HELLO.size:
                        continue
                    if secret.matches(got, expected):
                        selector.unregister(peer)
                        del waiting[peer]
                        peer.setblocking(True)
                        _quick(peer)
                        return peer
                    _drop(selector, waiting, peer, f"not the job's worker {index}")
        finally:
            for peer in list(waiting):
                peer.close()


def _take(listener: socket.socket, selector, waiting: dict) -> None:
    try:
        peer, address = listener.accept()
    except (BlockingIOError, InterruptedError):
        return
    peer.setblocking(False)
    if len(waiting) >= GREETING_PEERS:
        oldest = next(iter(waiting))
        _drop(selector, waiting, oldest, "too many connections greeting at once")
    selector.register(peer, selectors.EVENT_READ)
    waiting[peer] = [address, b"", time.monotonic() + GREETING_TIMEOUT_S]


def _drop(selector, waiting: dict, peer: socket.socket, why: str) -> None:
    address = waiting.pop(peer)[0]
    selector.unregister(peer)
    peer.close()
    secret.refused(WHAT, address, why)


def _quick(link: socket.socket) -> None:
    link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def receive_into(sock: socket.socket, out: np.ndarray) -> None:
    """Fill ``out`` with the next ``out.nbytes`` bytes from ``sock``."""
    view, got, size = memoryview(out).cast("B"), 0, out.nbytes
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if not n:
            raise ClusterError("a worker left the job in the middle of a sync round")
        got += n


def receive(sock: socket.socket, size: int) -> bytes:
    buffer = np.empty(size, np.uint8)
    receive_into(sock, buffer)
    return buffer.tobytes()
