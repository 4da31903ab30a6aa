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
in the chain, which answers the listener's challenge with the job's secret
(:mod:`kspipe.cluster.greetings`): read from every connection at once with a short
deadline, so a stranger that sends nothing, garbage, a wrong or a recorded greeting is
closed (one line in the log) while the worker before still gets in.  Once the chain is
made the listener is closed: nobody connects mid-job.
"""

from __future__ import annotations

import socket
import threading

import numpy as np

from kspipe.cluster import greetings
from kspipe.errors import ClusterError

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
PURPOSE = "chain"  # what its greetings answer


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
            self.next = connect((host, ports[self.index + 1]), self.index)
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


def connect(address: tuple, index: int) -> socket.socket:
    """Worker ``index``'s link to the next worker's listener at ``address``, greeted (the
    next worker answers once it has joined the chain on its own side)."""
    link = greetings.connect(address, PURPOSE, str(index), WHAT, ACCEPT_TIMEOUT_S)
    _quick(link)
    return link


def accept_from(listener: socket.socket, index: int) -> socket.socket:
    """The first connection to ``listener`` that greets as worker ``index`` with the job's
    secret (:class:`kspipe.cluster.greetings.Door`); every other is closed once it has said
    a greeting's length, or its time is up.  Closes the listener."""
    door = greetings.Door(listener, PURPOSE, [str(index)], WHAT, GREETING_PEERS, GREETING_TIMEOUT_S)
    try:
        found = door.next(ACCEPT_TIMEOUT_S)
    finally:
        door.close()
    if found is None:
        raise ClusterError(
            f"worker {index} did not join the sync chain within {ACCEPT_TIMEOUT_S:.0f} s"
        )
    _quick(found[1])
    return found[1]


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
