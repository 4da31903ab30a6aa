"""A job across hosts: its launchers keep one connection, so a failure anywhere stops it
everywhere.

Each host runs the same ``kspipe`` command with its own ``cluster.host``.  The first host,
the one with worker 0 (which records the run), listens on the control endpoint: worker
0's host at ``cluster.control_port`` (default: worker 0's port + 2).  Every other host's
launcher connects to it before starting its processes and answers its challenge as its
host with the job's secret, and the first host proves the same back
(:mod:`kspipe.cluster.greetings`); a connection that does not, within
:data:`HELLO_TIMEOUT_S`, is closed (one line in the log) and changes nothing.  Then:

* a launcher whose processes fail (or that is stopped by SIGTERM or Ctrl-C) sends
  ``failed <why>`` and stops its processes; the other launchers stop theirs and fail;
* a launcher that dies without a word (SIGKILL, a lost machine) closes the connection:
  the same happens, naming its host (its own processes die with it: see
  :class:`kspipe.launchers.watcher.Cluster`);
* a launcher whose part finished says ``done``.

With ``cluster.max_restarts`` (:mod:`kspipe.launchers.restarts`) the first host decides
whether the job starts again.  A failure's ``failed`` line is then preceded by ``kind
<why>`` (what the failure was: a restart cannot mend a user's error), and the first host
answers a failure, its own or another host's, with ``restart <n> <checkpoint> <why>``
(``-``: from the start) instead of ``failed``: each other launcher stops its processes
(or, where the failure was its own, waits for that word after its ``failed``), hangs up,
and starts its part again from that checkpoint, connecting anew to the first host, which
listens again on the same endpoint.

The first host fails the job if a host has not connected within ``cluster.hosts_timeout_s``.

A machine that loses power or is cut off sends nothing, not even a FIN: every launcher says
``alive`` on each of its connections every quarter of ``cluster.peer_timeout``, and one
not heard from for that long is lost (a failure a restart may mend, like a host's
launcher killed).  The first host is the one the others follow: its loss ends the job on
every other host within ``cluster.peer_timeout``, in one line.  kspipe does not restart a
job without it (it holds the run's record and decides the restarts); a scheduler's
requeue (Slurm's ``--requeue``) or ``resume=`` starts the job again from its latest
checkpoint.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

from kspipe.cluster import greetings
from kspipe.errors import ClusterError, ConfigError

CONNECT_RETRY_S = 0.5
#: How long a connection to the control endpoint has to greet.
HELLO_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class JobHosts:
    """The hosts of a job its endpoint lists name."""

    here: str
    first: str  # worker 0's host
    hosts: frozenset
    control: tuple  # (host, port) the first host listens on

    @property
    def is_first(self) -> bool:
        return self.here == self.first

    @property
    def others(self) -> set:
        return set(self.hosts) - {self.here}


def job_hosts(kind: str, cfg) -> JobHosts | None:
    """The hosts of a ``kind`` job across several hosts; None for a job on one host."""
    from kspipe.cluster.endpoints import parse_endpoints, this_host

    workers = parse_endpoints(cfg.workers, "workers")
    servers = parse_endpoints(cfg.servers, "servers") if kind == "pserver" else []
    if workers is None:
        return None
    everyone = (servers or []) + workers
    hosts = frozenset(e.rpartition(":")[0] for e in everyone)
    if len(hosts) == 1:
        return None
    here = this_host(cfg.cluster.host, everyone)
    first, _, port = workers[0].rpartition(":")
    control = cfg.cluster.get("control_port") or int(port) + 2
    taken = set(everyone) | {
        f"{e.rpartition(':')[0]}:{int(e.rpartition(':')[2]) + 1}" for e in (everyone[0], workers[0])
    }  # the gloo meeting points
    if f"{first}:{control}" in taken:
        raise ConfigError(
            f"the hosts' control endpoint {first}:{control} is an endpoint of "
            f"the job (or its gloo port): set cluster.control_port to a free port"
        )
    return JobHosts(here=here, first=first, hosts=hosts, control=(first, int(control)))


class HostLink:
    """This launcher's end of the job's control connections (see the module's doc)."""

    def __init__(self, hosts: JobHosts, timeout_s: float = 300.0, peer_timeout: float = 15.0):
        self.hosts = hosts
        self.timeout_s = timeout_s
        self.peer_timeout = peer_timeout
        self._heard: dict[str, float] = {}  # when each connected host last said anything
        self._failure: str | None = None
        self._peers: dict[str, socket.socket] = {}
        self._done: set = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._opened = 0.0
        self._closing = False
        self._kind: dict[str, str] = {}  # a host's failure's kind (its ``kind`` line)
        self.restart: int | None = None  # the first host's word: restart number n,
        self.restart_from: str | None = None  # from this checkpoint (None: the start)
        self._answered = threading.Event()  # the first host said restart or failed, or left

    # --- opening ------------------------------------------------------------------

    def open(self, say) -> None:
        """The first host listens; the others connect (retrying until the timeout)."""
        self._opened = time.monotonic()
        threading.Thread(target=self._beat, daemon=True, name="kspipe-alive").start()
        if self.hosts.is_first:
            self._listen()
            say(
                f"waiting for the launchers of {', '.join(sorted(self.hosts.others))} on "
                f"{self._endpoint()}"
            )
        else:
            say(f"connecting to the first host's launcher on {self._endpoint()}")
            self._connect()

    def _endpoint(self) -> str:
        return "%s:%d" % self.hosts.control

    def _listen(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(self.hosts.control)
        except OSError as err:
            listener.close()
            raise ConfigError(
                f"the hosts' control endpoint {self._endpoint()} cannot be "
                f"opened ({err.strerror}): set cluster.control_port"
            ) from err
        listener.listen()
        self._listener = listener
        what = f"the control endpoint {self._endpoint()}"
        door = greetings.Door(listener, "hosts", self.hosts.others, what, 16, HELLO_TIMEOUT_S)
        threading.Thread(target=self._accept, args=(door,), daemon=True).start()

    def _accept(self, door: greetings.Door) -> None:
        try:
            while not self._closing:
                host, conn = door.next(admit=self._admit)  # OSError once the listener closed
                threading.Thread(target=self._serve, args=(host, conn), daemon=True).start()
        except OSError:
            return
        finally:
            door.close()

    def _admit(self, host: str, conn: socket.socket) -> None:
        """A host in (before it learns so: a word sent to the hosts from now on reaches it)."""
        with self._lock:
            self._peers[host] = conn
            self._heard[host] = time.monotonic()

    def _serve(self, host: str, conn: socket.socket) -> None:
        self._read(host, conn.makefile("r", encoding="utf-8", errors="replace"))

    def _connect(self) -> None:
        deadline = self._opened + self.timeout_s
        while True:
            try:
                conn = greetings.connect(
                    self.hosts.control, "hosts", self.hosts.here, "the first host's launcher", 5
                )
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"the first host's launcher did not answer on "
                        f"{self._endpoint()} within cluster.hosts_timeout_s="
                        f"{self.timeout_s:g} s ({err.strerror or err})"
                    ) from err
                time.sleep(CONNECT_RETRY_S)
        first = self.hosts.first
        with self._lock:
            self._peers[first] = conn
            self._heard[first] = time.monotonic()
        lines = conn.makefile("r", encoding="utf-8", errors="replace")
        threading.Thread(target=self._read, args=(first, lines), daemon=True).start()

    def _read(self, host: str, lines) -> None:
        try:
            for line in lines:
                self._heard[host] = time.monotonic()
                word, _, why = line.strip().partition(" ")
                if word == "done":
                    with self._lock:
                        self._done.add(host)
                elif word == "kind":
                    self._kind[host] = why
                elif word == "failed":
                    self._fail(Relayed(relayed(host, why), self._kind.get(host, "host")))
                    self._answered.set()
                elif word == "restart":
                    number, _, why = why.partition(" ")
                    start, _, why = why.partition(" ")
                    self.restart = int(number) if number.isdigit() else 0
                    self.restart_from = None if start == "-" else start
                    self._fail(Relayed(f"the first host restarts the job: {why}", "restart"))
                    self._answered.set()
        except OSError:
            pass
        self._answered.set()
        with self._lock:
            done = host in self._done
        if not done and not self._closing:
            self._fail(
                Relayed(f"the launcher on {host} went away (killed, or its machine was lost)")
            )

    def _beat(self) -> None:
        """Say ``alive`` on every connection every quarter of the peer timeout."""
        while not self._closing:
            time.sleep(self.peer_timeout / 4)
            if not self._closing:
                self._send("alive\n")

    def _check_heard(self) -> None:
        """Fail the job where a connected host has said nothing for the peer timeout."""
        now = time.monotonic()
        with self._lock:
            silent = sorted(
                h for h in self._peers if now - self._heard.get(h, now) > self.peer_timeout
            )
        if silent and not self._closing:
            self._fail(
                Relayed(
                    f"the launcher on {silent[0]} was not heard from for "
                    f"cluster.peer_timeout={self.peer_timeout:g} s (its machine was lost or "
                    f"cut off)"
                )
            )
            self._answered.set()  # no answer will come from it

    def _fail(self, message: str) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = message

    # --- watching and closing -----------------------------------------------------

    def failure(self) -> str | None:
        """Why the job failed elsewhere, if it did; Cluster.wait polls it."""
        self._check_heard()
        if (
            self._failure is None
            and self.hosts.is_first
            and time.monotonic() - self._opened > self.timeout_s
        ):
            with self._lock:
                missing = self.hosts.others - set(self._peers)
            if missing:
                self._fail(
                    Relayed(
                        f"the launcher of {', '.join(sorted(missing))} did not connect to "
                        f"{self._endpoint()} within cluster.hosts_timeout_s="
                        f"{self.timeout_s:g} s",
                        "timeout",
                    )
                )
        return self._failure

    def outcome(self, timeout_s: float | None = None) -> str | None:
        """A host other than the first, its own processes done: wait for the first host's
        word on the job (its servers end as the job ends, however it ends); why the job
        failed, or None when it finished."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self.hosts.first in self._done:
                    return None
            self._check_heard()
            if self._failure is not None:
                return self._failure
            if deadline is not None and time.monotonic() > deadline:
                return f"no word from the first host's launcher within {timeout_s:g} s"
            time.sleep(0.1)

    def close(
        self,
        failure: str | None = None,
        kind: str = "",
        restart: int | None = None,
        answer_s: float = 0.0,
        start: str | None = None,
    ) -> None:
        """Tell the other launchers this host's part is done, or why it failed (``kind``:
        what the failure was), or, on the first host, that the job starts again as restart
        ``restart`` from the checkpoint named ``start`` (None: from its start); hang up.
        ``answer_s``: on another host, wait as long for the first host's answer to a
        failure (``restart`` sets :attr:`restart`)."""
        one_line = " ".join((failure or "").split())
        if failure is None:
            message = "done\n"
        elif restart is not None:
            message = f"restart {restart} {start or '-'} {one_line}\n"
        else:
            message = (f"kind {kind}\n" if kind else "") + f"failed {one_line}\n"
        if answer_s and failure is not None and not self.hosts.is_first:
            self._send(message)
            self._answered.wait(answer_s)
        self._closing = True
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for conn in peers:
            try:
                conn.sendall(message.encode())
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _send(self, message: str) -> None:
        with self._lock:
            peers = list(self._peers.values())
        for conn in peers:
            try:
                conn.sendall(message.encode())
            except OSError:
                pass


class Relayed(str):
    """A failure from the job's control link, with the kind of failure it was
    (a :class:`kspipe.launchers.restarts.Why` value)."""

    def __new__(cls, text: str, why: str = "host"):
        made = super().__new__(cls, text)
        made.why = why
        return made


#: What :meth:`kspipe.launchers.watcher.Cluster.wait` adds to a failure from elsewhere.
STOPPED = "; this host's processes were stopped"


def relayed(host: str, why: str) -> str:
    """The failure ``host`` sent: named once by the host where it began (the first host
    passes on what another host sent it)."""
    why = why.removesuffix(STOPPED)
    return why if why.startswith("the job failed on ") else f"the job failed on {host}: {why}"
