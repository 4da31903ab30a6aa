"""A shard summer: beside a parameter server, on its host, it sums one slice of every sync
(and geo) round's array over the workers and sends the total slice back to each of them.

Part of a round's array goes along the workers' chain (:mod:`kspipe.modes.summing`), the
rest in slices to one summer per server (:mod:`kspipe.modes.ps.sharded` says which part,
and why): the servers' links, idle in a sync round, then carry part of its bytes.

Why a process of its own: Paddle's server loop (``fleet.run_server``) holds the Python
interpreter's lock in C++, so a thread of the server's process would never run.  The
server binds the listener on its own address, starts this module with it
(:func:`launch`) and announces its port; the summer imports numpy, the standard library
and the job's secret (:mod:`kspipe.cluster.secret`) only.

Every element is added in worker order, ``((v0 + v1) + v2) + ...``, in the array's dtype,
as the chain adds: the total is the chain's bit for bit.  The slice moves a chunk at a
time, so the totals of the first chunks go back while the later ones still come in; each
worker's link takes its totals as fast as it can, whatever the others' do.

What a peer can make it do: a connection counts only once it answers the summer's
challenge as a worker that has not joined yet, with the job's secret
(:mod:`kspipe.cluster.greetings`: every connection's greeting read at once, each with a
short deadline, so a stranger delays no worker; any other is closed, said in one line of
the server's log, and the summer goes on); no index or length is ever read from a peer
(both sides know the slice's size).  It ends when its standard input
closes (its server ended, however it ended), and when any worker's link closes or fails:
at the job's end, or when a worker leaves mid-round; its links then close (once the totals
already summed have gone out), so every other worker's round fails rather than waits.
"""

from __future__ import annotations

import collections
import os
import queue
import select
import socket
import subprocess
import sys
import threading

import numpy as np

from kspipe.cluster import greetings

WHAT = "a shard summer"
PURPOSE = "summer"  # what its greetings answer
#: A chunk: its total goes back once every worker's chunk is in, so a round's first
#: total waits for ``workers`` chunks on the server's link; small keeps that short.
CHUNK_BYTES = 1 << 15
#: How long the sender waits on full links before it takes the totals summed meanwhile.
TAKE_EVERY_S = 0.005
#: How long a connection may take to greet.
HELLO_TIMEOUT_S = greetings.PATIENCE_S
#: Once one worker is in, how long the others may take to join.
JOIN_TIMEOUT_S = 300.0
#: How long the totals already summed may take to go out when the summer ends (a worker
#: that takes none fails its round as the links close).
DRAIN_TIMEOUT_S = 60.0


class Left(Exception):
    """A link closed (a worker left, or the job ended)."""


def launch(
    listener: socket.socket,
    workers: int,
    length: int,
    dtype: str,
    chunk_bytes: int = CHUNK_BYTES,
) -> subprocess.Popen:
    """Start a summer on ``listener`` (bound and listening; this process's copy is closed)
    for ``workers`` workers' slices of ``length`` values of ``dtype``.  It ends when the
    returned process's standard input closes: keep the object while the summer is needed."""
    fd = listener.fileno()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kspipe.modes.ps.summer",
            str(fd),
            str(workers),
            str(length),
            dtype,
            str(chunk_bytes),
        ],
        stdin=subprocess.PIPE,
        pass_fds=(fd,),
    )
    listener.close()
    return process


def accept_workers(listener: socket.socket, workers: int) -> list:
    """One link from each worker, in index order: the first connection that greets as each
    worker (:func:`greet`); every other connection is closed.  Closes the listener."""
    links: list = [None] * workers
    door = greetings.Door(
        listener, PURPOSE, map(str, range(workers)), WHAT, patience_s=HELLO_TIMEOUT_S
    )
    try:
        wait = None  # the first worker comes when training starts
        while None in links:
            found = door.next(wait)
            if found is None:
                raise Left(f"the workers did not all join within {JOIN_TIMEOUT_S:.0f} s")
            name, link = found
            door.names.discard(name)  # the name is one of the door's own, not a peer's bytes
            link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            links[int(name)] = link
            wait = JOIN_TIMEOUT_S
    except BaseException:
        end_links([link for link in links if link is not None])
        raise
    finally:
        door.close()
    return links


def greet(address: tuple, index: int, timeout_s: float) -> socket.socket:
    """Worker ``index``'s link to the summer at ``address``, greeted with the job's secret."""
    return greetings.connect(address, PURPOSE, str(index), WHAT, timeout_s)


def sum_rounds(links: list, length: int, dtype: str, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Sum round after round until a link closes (raises :class:`Left`) or fails
    (``OSError``).  The totals go back on a thread of their own, in the order summed."""
    dtype = np.dtype(dtype)
    step = max(1, chunk_bytes // dtype.itemsize)
    chunks = [(at, min(at + step, length)) for at in range(0, length, step)]
    scratch = np.empty(step, dtype)
    outgoing: queue.Queue = queue.Queue()
    failed: list = []
    sender = threading.Thread(target=send_totals, args=(links, outgoing, failed), daemon=True)
    sender.start()
    try:
        while not failed:
            total = np.empty(length, dtype)  # a new one a round: the last may still be sending
            for start, end in chunks:
                into = total[start:end]
                receive_into(links[0], into)
                for link in links[1:]:
                    other = scratch[: end - start]
                    receive_into(link, other)
                    np.add(into, other, out=into)
                outgoing.put(into)
        raise failed[0]
    finally:  # the totals summed go out first: at the job's end, the first worker to
        outgoing.put(None)  # leave ends the summer while the others still take theirs
        sender.join(DRAIN_TIMEOUT_S)


def send_totals(links: list, outgoing: queue.Queue, failed: list) -> None:
    """Each total chunk, as it is summed, to every worker.  A link takes what it can
    without waiting: a worker whose own link is full (its chain, the other summers) does
    not hold back the totals of the others, whose share of this host's link would go
    unused (BENCHMARKS.md).  The thread waits only when no link has totals to go, or every
    link that has is full."""
    behind = [collections.deque() for _ in links]  # a link's totals not yet sent
    ended = False
    try:
        while not ended or any(behind):
            ended = take_summed(outgoing, behind, wait=not any(behind)) or ended
            for link, waiting in zip(links, behind):
                while waiting:
                    try:
                        sent = link.send(waiting[0], socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        break
                    if sent < len(waiting[0]):
                        waiting[0] = waiting[0][sent:]
                    else:
                        waiting.popleft()
            full = [link for link, waiting in zip(links, behind) if waiting]
            if full:  # a short wait: a total summed meanwhile is for the others too
                wait_writable(full, TAKE_EVERY_S)
    except (OSError, ValueError) as err:  # ValueError: a link closed under it (at the end)
        failed.append(err)
        end_links(links)  # wakes the summing thread, blocked on a link


def take_summed(outgoing: queue.Queue, behind: list, wait: bool) -> bool:
    """Queue every chunk summed so far for every link (waiting for one if ``wait``);
    whether the summing has ended."""
    try:
        chunk = outgoing.get(block=wait)
        while chunk is not None:
            view = memoryview(chunk).cast("B")
            for waiting in behind:
                waiting.append(view)
            chunk = outgoing.get_nowait()
        return True
    except queue.Empty:
        return False


def wait_writable(links: list, timeout_s: float) -> None:
    poller = select.poll()
    for link in links:
        poller.register(link, select.POLLOUT)
    poller.poll(timeout_s * 1000)


def end_links(links: list) -> None:
    """Shut and close every link: each worker's round fails at once (a shut link also wakes
    a thread of this process blocked on it)."""
    for link in links:
        try:
            link.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        link.close()


def receive_into(link: socket.socket, out: np.ndarray) -> None:
    view, got, size = memoryview(out).cast("B"), 0, out.nbytes
    while got < size:
        n = link.recv_into(view[got:], size - got)
        if not n:
            raise Left("a worker's link closed")
        got += n


def receive(link: socket.socket, size: int) -> bytes:
    buffer = np.empty(size, np.uint8)
    receive_into(link, buffer)
    return buffer.tobytes()


def main(argv: list) -> int:
    fd, workers, length, dtype = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    chunk_bytes = int(argv[4]) if len(argv) > 4 else CHUNK_BYTES
    listener = socket.socket(fileno=fd)

    def end_with_server() -> None:
        sys.stdin.buffer.read()  # returns when the server's end of the pipe closes
        os._exit(0)

    threading.Thread(target=end_with_server, daemon=True).start()
    links: list = []
    try:
        links = accept_workers(listener, workers)
        sum_rounds(links, length, dtype, chunk_bytes)
    except (Left, OSError):  # the job's end, or a worker left: the workers tell which
        pass
    finally:
        end_links([link for link in links if link is not None])
    return 0


if __name__ == "__main__":
    # not through the interpreter's shutdown: its thread waiting on stdin would stop it
    os._exit(main(sys.argv[1:]))
