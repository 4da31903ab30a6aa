"""Where a job's processes meet to set up gloo, in milliseconds.

Gloo's worlds are set up through a store of addresses.  Paddle 2.6.2 offers a folder,
where a process that finds a peer's address missing sleeps 10 s before it looks again, or
HTTP, whose key-value server the first process checks on in 3-5 s sleeps (and the others
wait for in 3 s sleeps): every job waited 3-10 s to begin.  Here the first process starts
an address book of kspipe's own (:mod:`kspipe.cluster.addresses`), every process waits for
it in 20 ms polls, and Paddle's own gloo meets through it: a job meets in well under a
second.  Fleet's worlds in a parameter-server job (the workers', the servers', and with
``PADDLE_WITH_GLOO=2`` everyone's) meet through :class:`MeetingRoleMaker` (server 0 serves
the book), the collective mode's CPU world through :func:`gloo_context` (worker 0 does).

Only the job's processes reach its keys: their path begins with a token of the job's
secret (:mod:`kspipe.cluster.addresses`, :mod:`kspipe.cluster.secret`).

The environment contract stays Paddle's (``PADDLE_GLOO_RENDEZVOUS=3`` with
``PADDLE_GLOO_HTTP_ENDPOINT``, served by server 0), so Paddle's launcher and a scheduler's
manifests start the same jobs; a folder (``PADDLE_GLOO_RENDEZVOUS=2``) still meets Paddle's
way.
"""

from __future__ import annotations

import os
import subprocess
import sys

import paddle.distributed.fleet as fleet
from paddle.base import core

from kspipe.cluster import secret
from kspipe.cluster.endpoints import interface_of, wait_for_listener
from kspipe.errors import ClusterError

#: How long a process waits for server 0's address book, and for its world to meet.
MEET_TIMEOUT_S = 900
#: How long one collective of a world may wait for its slowest member (Paddle's own).
RUN_TIMEOUT_S = 9999999


class MeetingRoleMaker(fleet.PaddleCloudRoleMaker):
    """Paddle's role maker read from the environment, whose gloo worlds meet in the
    address book that server 0 serves at ``PADDLE_GLOO_HTTP_ENDPOINT``."""

    book: subprocess.Popen | None = None  # server 0: the address book's process

    # Paddle 2.6.2 has no public way to hand its role maker gloo worlds: _gloo_init is the
    # method that makes them, and its Gloo's _worker_comm, _server_comm, _nodes_comm and
    # _is_initialized are what fleet.util's barrier and collectives read.
    def _gloo_init(self):
        world = os.environ.get("PADDLE_WITH_GLOO", "0")
        if world not in ("1", "2") or os.environ.get("PADDLE_GLOO_RENDEZVOUS") != "3":
            return super()._gloo_init()
        host, _, port = os.environ["PADDLE_GLOO_HTTP_ENDPOINT"].rpartition(":")
        port = int(port)
        if self._is_server() and self._server_index() == 0:
            self.book = open_book(host, port, self._worker_num() + self._server_num())
        else:
            wait_for(host, port)
        workers, servers, gloo = self._worker_num(), self._server_num(), self._gloo
        if self._is_worker():
            gloo._worker_comm = meet(host, port, "worker", self._worker_index(), workers)
        else:
            gloo._server_comm = meet(host, port, "server", self._server_index(), servers)
        if world == "2":
            rank = self._worker_index() if self._is_worker() else workers + self._server_index()
            gloo._nodes_comm = meet(host, port, "all", rank, workers + servers)
        gloo._is_initialized = True


def gloo_context(rank: int, size: int, endpoint: str):
    """The process's one gloo world of ``size`` members (the one Paddle's CPU collective
    ops use), met through the address book at ``endpoint``, which rank 0 serves; returns
    it (``barrier()``, ``release()``) and the book's process (rank 0), to keep.  Paddle's
    context takes no key prefix: it meets through a relay on loopback that adds the job's
    (:mod:`kspipe.cluster.addresses`), ended once the world has met."""
    host, _, port = endpoint.rpartition(":")
    relay = spawn(["relay", host, port, str(rank)])  # it starts while the book does
    try:
        book = open_book(host, int(port), size) if rank == 0 else wait_for(host, int(port))
        ready(relay, "the relay to the job's gloo meeting point did not start")
        strategy = core.GlooParallelStrategy()
        strategy.rank, strategy.rank_num = rank, size
        strategy.ip_address = "127.0.0.1"
        strategy.ip_port = int(relay.said.split()[1])
        iface = interface_of(own_address())  # as meet(): not the loopback of the host's name
        if iface:
            strategy.iface = iface
        strategy.init_seconds, strategy.run_seconds = MEET_TIMEOUT_S, RUN_TIMEOUT_S
        context = core.GlooParallelContext(strategy)
        context.init()
    finally:
        relay.stdin.close()
        relay.wait()
    return context, book


def open_book(host: str, port: int, members: int) -> subprocess.Popen:
    """Start the address book of a job of ``members`` processes on ``port`` of this host (on
    ``host``'s address where this machine holds it, else on every interface) and return
    once it serves there; it ends when this process does."""
    book = spawn([str(port), host, str(members)])
    return ready(book, f"the job's gloo meeting point could not take port {port}")


def spawn(args: list[str]) -> subprocess.Popen:
    """Start a process of :mod:`kspipe.cluster.addresses` (it ends when this one does)."""
    secret.current()  # a process without the job's secret stops here, in one line
    return subprocess.Popen(
        [sys.executable, "-m", "kspipe.cluster.addresses", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def ready(process: subprocess.Popen, failed: str) -> subprocess.Popen:
    """``process`` once it says it is ready (what it said in ``.said``); ``failed``: the
    error when it does not."""
    process.said = process.stdout.readline().strip()
    if not process.said.startswith("ready"):  # it said why in this process's log
        raise ClusterError(f"{failed} (this log says why)")
    return process


def meet(host: str, port: int, world: str, rank: int, size: int):
    """Paddle's gloo world ``world`` of ``size`` members, met through the address book."""
    gloo = core.Gloo()
    gloo.set_rank(rank)
    gloo.set_size(size)
    gloo.set_prefix(secret.token("gloo"))  # the book's keys: only the job knows the way
    # the interface of this process's own address (a parameter-server job's POD_IP, a
    # collective worker's PADDLE_CURRENT_ENDPOINT): left to itself, gloo announces what
    # this host's name resolves to, often a loopback address
    gloo.set_iface(interface_of(own_address()))
    gloo.set_timeout_seconds(MEET_TIMEOUT_S, RUN_TIMEOUT_S)
    gloo.set_http_store(host, port, world)
    gloo.init()
    return gloo


def own_address(env=os.environ) -> str:
    """This process's address in its job, as its launcher told it ("" if it did not)."""
    return env.get("POD_IP") or env.get("PADDLE_CURRENT_ENDPOINT", "").rpartition(":")[0]


def wait_for(host: str, port: int) -> None:
    """Return (None) once the address book at ``host:port`` accepts connections."""
    wait_for_listener(host, port, MEET_TIMEOUT_S, f"the job's gloo meeting point {host}:{port}")
