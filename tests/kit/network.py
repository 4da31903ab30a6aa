"""An emulated cluster on this machine, for tests and benches: hosts that are network
namespaces, each with an address of its own, joined through one bridge by links of a chosen
bandwidth.  Root only; nothing of it touches the machine's own network.

    with Network(hosts=4, mbit=1000) as net:
        first = net.hosts[0]           # first.address == "10.77.0.1"
        job = first.popen(["kspipe", ..., f"cluster.host={first.address}"])

The layout of a network ``<pid>-<n>`` (the ``n``-th one process ``pid`` made):

* the namespace ``kspipe-net-<pid>-<n>-bridge`` holds the bridge ``br0`` (with no address:
  nothing runs there);
* host ``i`` (from 1) is the namespace ``kspipe-net-<pid>-<n>-h<i>``: its loopback and its
  link's end ``eth0``, address ``<subnet>.<i>/24``, are up; the link's other end, ``h<i>``
  in the bridge's namespace, is a port of ``br0``;
* in each host, the machine's host name resolves to that host's address, and ``h<i>`` to
  host ``i``'s, as on a cluster's machines: ``ip netns exec`` puts the file
  ``/etc/netns/<namespace>/hosts`` in the place of ``/etc/hosts`` (``names=False`` leaves the
  machine's own).  Paddle's gloo announces the address the host name resolves to;
* both ends of every link send through a token bucket (``tc ... tbf``) at the link's rate,
  so each direction of a link carries at most ``mbit`` Mbit/s (``netem`` is not in every
  kernel: the links add no latency);
* every host's TCP uses the congestion control ``congestion`` (``cubic``, Linux's own
  default, unless told otherwise; ``None``: the machine's).  The hosts are stock machines
  whatever this one runs: a machine whose default is BBR (v1) gave each host BBR, which
  through these shallow tail-drop queues lost one segment in ten with 16 or more flows a
  link (docs/benchmark-log.md).  A namespace may take only a congestion control the
  machine allows (``net.ipv4.tcp_allowed_congestion_control``): one missing there is
  added while a network is open, and the list is put back when the last one (of any
  process) closes.

A host's commands (:meth:`Host.popen`, :meth:`Host.run`) run through ``ip netns exec``: in
the host's network, on the machine's one filesystem.

Cleaning up: :meth:`Network.close` (the ``with`` block's end, an exception included, the
interpreter's exit, SIGTERM and SIGINT) kills the processes still in the network's namespaces
(``ip netns pids``) and deletes the namespaces (the links and the bridge go with them) and
their ``/etc/netns`` folders.  A process killed by SIGKILL cleans nothing, so every network
first removes those whose maker has ended (:func:`clear_stale`): their names hold their
maker's process id.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

PREFIX = "kspipe-net-"
BRIDGE = "br0"
ETC = "/etc/netns"  # ip netns exec's files of each namespace
KILL_WAIT_S = 10.0


class NetworkUnavailable(RuntimeError):
    """The emulated network cannot be made here; the message is one line saying why."""


@functools.cache
def unavailable() -> str | None:
    """Why no emulated network can be made on this machine (not root, no ``ip`` or ``tc``,
    a shaped link the kernel refuses), or None; tried once a process, with a network of one
    host made and removed."""
    try:
        with Network(hosts=1):
            pass
    except NetworkUnavailable as err:
        return str(err)
    return None


def _check_tools() -> None:
    if os.geteuid() != 0:
        raise NetworkUnavailable("an emulated network needs root (ip netns, tc)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("sysctl", "procps")):
        if shutil.which(tool) is None:
            raise NetworkUnavailable(
                f"an emulated network needs the `{tool}` command (apt-get install -y {package})"
            )


def _run(*command: str) -> str:
    """Run an ``ip`` or ``tc`` command; its output, or :class:`NetworkUnavailable` naming
    the command and the first line of its complaint."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[0]
        raise NetworkUnavailable(
            f"cannot make the emulated network: `{' '.join(command)}` failed: {why}"
        )
    return result.stdout


def namespaces(prefix: str = PREFIX) -> list[str]:
    """The network namespaces whose names start with ``prefix`` (by default every emulated
    network's, whoever made it)."""
    if shutil.which("ip") is None:
        return []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [
        line.split()[0]
        for line in names.splitlines()
        if line.split() and line.split()[0].startswith(prefix)
    ]


def files(prefix: str = PREFIX) -> list[str]:
    """The folders of ``/etc/netns`` whose names start with ``prefix``."""
    try:
        return [name for name in os.listdir(ETC) if name.startswith(prefix)]
    except OSError:
        return []


def processes_in(namespace: str) -> list[int]:
    """The processes in the network namespace ``namespace``."""
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def remove(names: list[str]) -> None:
    """Kill the processes in the namespaces ``names`` (SIGKILL: what runs there is a test's,
    and it is over), wait until they are gone, and delete the namespaces and their
    ``/etc/netns`` folders (and that folder, once empty)."""
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        left = [pid for name in names for pid in processes_in(name)]
        if not left or time.monotonic() > deadline:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    for name in names:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        shutil.rmtree(os.path.join(ETC, name), ignore_errors=True)
    try:
        os.rmdir(ETC)  # if nothing else is in it
    except OSError:
        pass


def _maker(namespace: str) -> int | None:
    """The process id in an emulated network's namespace name, or None."""
    pid = namespace.removeprefix(PREFIX).split("-")[0]
    return int(pid) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear_stale() -> list[str]:
    """Remove the emulated networks whose maker has ended (killed by SIGKILL, which leaves
    everything in place) with the processes still in them; their namespaces' names."""
    stale = [
        name
        for name in sorted(set(namespaces() + files()))
        if (pid := _maker(name)) and not _alive(pid)
    ]
    remove(stale)
    return stale


@dataclass(frozen=True)
class Host:
    """A host of the emulated network: its own namespace and address."""

    name: str  # h1, h2, ...
    address: str
    namespace: str

    def command(self, args: list[str]) -> list[str]:
        """``args`` run in this host's network."""
        return ["ip", "netns", "exec", self.namespace, *args]

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        """``args`` started in this host's network (``kwargs`` as ``subprocess.Popen``'s)."""
        return subprocess.Popen(self.command(args), **kwargs)

    def run(self, args: list[str], **kwargs) -> subprocess.CompletedProcess:
        """``args`` run to the end in this host's network (``kwargs`` as
        ``subprocess.run``'s)."""
        return subprocess.run(self.command(args), **kwargs)


_serial = itertools.count(1)
_open: set = set()  # the networks of this process not yet closed
_lock = threading.RLock()  # a signal's handler may close networks while one is made


class Network:
    """``hosts`` hosts at ``<subnet>.1`` ... on one bridge, each linked to it at ``mbit``
    Mbit/s each way; made on entering a ``with`` block (or by :meth:`start`), removed by
    :meth:`close` however the process ends, short of SIGKILL (see the module's doc).
    ``names=False`` leaves every host the machine's ``/etc/hosts`` (where the machine's name
    may be a loopback address, as Debian's installer writes it)."""

    def __init__(
        self,
        hosts: int = 4,
        mbit: float = 1000,
        subnet: str = "10.77.0",
        names: bool = True,
        congestion: str | None = "cubic",
    ):
        if not 1 <= hosts <= 250:
            raise ValueError(f"an emulated network has 1 to 250 hosts, not {hosts}")
        if not mbit > 0:
            raise ValueError(f"a link's rate is a positive number of Mbit/s, not {mbit}")
        self.mbit = mbit
        self.names = names
        self.congestion = congestion
        self.name = f"{PREFIX}{os.getpid()}-{next(_serial)}-"
        self.bridge = self.name + "bridge"
        self.hosts = [
            Host(f"h{i}", f"{subnet}.{i}", f"{self.name}h{i}") for i in range(1, hosts + 1)
        ]

    def __enter__(self) -> Network:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> Network:
        """Make the network: first the check (root, ``ip``, ``tc``), then the stale networks
        of ended processes removed, then this one's namespaces, bridge and links; anything
        refused raises :class:`NetworkUnavailable`, with what was made removed."""
        _check_tools()
        clear_stale()
        with _lock:
            _open.add(self)
        _watch_signals()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def _make(self) -> None:
        br = self.bridge
        _run("ip", "netns", "add", br)
        _run("ip", "-n", br, "link", "set", "lo", "up")
        _run("ip", "-n", br, "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "-n", br, "link", "set", BRIDGE, "up")
        for host in self.hosts:
            ns = host.namespace
            if self.names:
                self._name_hosts(host)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if self.congestion:
                _allow(self.congestion)
                _run(*host.command(["sysctl", "-qw", f"{CONGESTION}={self.congestion}"]))
            _run(*f"ip -n {br} link add {host.name} type veth peer name eth0 netns {ns}".split())
            _run("ip", "-n", br, "link", "set", host.name, "master", BRIDGE)
            _run("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            self._shape(br, host.name)
            self._shape(ns, "eth0")
            _run("ip", "-n", br, "link", "set", host.name, "up")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")

    def _name_hosts(self, host: Host) -> None:
        """``host``'s own ``/etc/hosts``: the machine's name is its address, and ``h<i>`` is
        host ``i``'s."""
        names = "".join(f"{other.address} {other.name}\n" for other in self.hosts)
        path = os.path.join(ETC, host.namespace, "hosts")
        try:
            try:
                os.makedirs(os.path.dirname(path))
            except FileNotFoundError:  # another network's removal took /etc/netns meanwhile
                os.makedirs(os.path.dirname(path))
            with open(path, "w") as f:
                f.write(f"127.0.0.1 localhost\n{host.address} {socket.gethostname()}\n{names}")
        except OSError as err:
            raise NetworkUnavailable(
                f"cannot make the emulated network: {path}: {err.strerror}"
            ) from err

    def _shape(self, namespace: str, device: str) -> None:
        """What ``device`` sends, at most the link's rate: a token bucket holding 1 ms of
        traffic at that rate (at least 64 KiB, so a large segment passes whole) and queueing
        at most 20 ms of it."""
        burst = max(int(self.mbit * 1e6 / 8 / 1000), 64 * 1024)
        rate = f"{round(self.mbit * 1e6)}bit"
        _run(*f"tc -n {namespace} qdisc add dev {device} root tbf rate {rate}".split(),
             *f"burst {burst} latency 20ms".split())  # fmt: skip

    def cut(self, host: Host) -> None:
        """Cut ``host`` off the bridge as a pulled cable does: nothing more reaches it or
        leaves it, and no FIN or RST tells anyone."""
        _run("ip", "-n", self.bridge, "link", "set", host.name, "down")

    def namespaces(self) -> list[str]:
        """This network's namespaces that exist now, and any ``/etc/netns`` folder left of
        one."""
        return sorted(set(namespaces(self.name) + files(self.name)))

    def close(self) -> None:
        """Kill the processes in this network's namespaces and delete them (and with them
        the links and the bridge); nothing if it is closed already."""
        with _lock:
            _open.discard(self)
            last = not _open
        remove(self.namespaces())
        if last and not namespaces():  # no network of another process either
            _put_back_allowed()


CONGESTION = "net.ipv4.tcp_congestion_control"
ALLOWED = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"
_allowed_before: list[str] = []  # the machine's list, while a network has added to it


def _allow(congestion: str) -> None:
    """Let namespaces take ``congestion`` (the machine's list of allowed ones)."""
    with _lock, open(ALLOWED) as f:
        allowed = f.read().split()
        if congestion in allowed:
            return
        if not _allowed_before:
            _allowed_before.append(" ".join(allowed))
        try:
            with open(ALLOWED, "w") as out:
                out.write(" ".join([*allowed, congestion]))
        except OSError as err:
            raise NetworkUnavailable(
                f"cannot give the emulated hosts TCP {congestion}: {ALLOWED}: {err.strerror}"
            ) from err


def _put_back_allowed() -> None:
    with _lock:
        if _allowed_before:
            with open(ALLOWED, "w") as out:
                out.write(_allowed_before.pop())


def _close_all() -> None:
    with _lock:
        networks = list(_open)
    for network in networks:
        network.close()


atexit.register(_close_all)


_watching: list[int] = []  # the signals whose handler closes this process's networks


def _watch_signals() -> None:
    """On SIGTERM and SIGINT, close this process's networks, then do what the signal did
    before (SIGINT: Python's KeyboardInterrupt; SIGTERM: by default, end the process).
    Installed once, by the first network made in the main thread (only it may)."""
    if _watching or threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        before = signal.getsignal(signum)
        if before != signal.SIG_IGN:  # an ignored signal stays ignored
            signal.signal(signum, functools.partial(_on_signal, before=before))
        _watching.append(signum)


def _on_signal(signum, frame, before) -> None:
    _close_all()
    if callable(before):
        before(signum, frame)
    else:  # the default (or a handler not Python's): end as the signal ends a process
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
