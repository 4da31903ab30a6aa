"""Endpoint lists and process counts as the config gives them, free ports, and waiting
for a port to listen.

``workers`` and ``servers`` are each a count or a ``host:port`` list; every module that
reads them (the config's checks, the modes' plans, the launchers) reads them here.
"""

from __future__ import annotations

import socket
import time

from omegaconf import ListConfig

from kspipe.errors import ClusterError, ConfigError, check_integer


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that are free on ``host`` right now."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def check_port_free(host: str, port: int) -> None:
    """Whether a process of the job can listen on ``host:port``: no socket listens there.
    The connections of an earlier start of the job (a restart on the same endpoints) may
    linger in TIME_WAIT; the job's servers listen with SO_REUSEADDR, as this check does."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as err:
        raise ConfigError(f"port {host}:{port} is not free: {err.strerror}") from err
    finally:
        s.close()


def parse_endpoints(value, key: str) -> list[str] | None:
    """An endpoint list from the config, or None for a count.

    The list is ``[host:port,...]`` (Hydra's list syntax, as a YAML list) or a quoted string
    ``'host:port,...'``; anything else must be a whole count of at least 1.
    """
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple, ListConfig)):
        items = [str(item) for item in value]
    else:
        check_integer(value, key, 1)
        return None
    endpoints = [e.strip() for e in items if e.strip()]
    if not endpoints:
        raise ConfigError(f"{key}={value!r} is neither a count nor a host:port list")
    for endpoint in endpoints:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"{key}: {endpoint!r} is not host:port (a count of at least 1 "
                f"or a host:port list, e.g. {key}=[10.0.0.1:7001,10.0.0.2:7001])"
            )
    if len(set(endpoints)) != len(endpoints):
        raise ConfigError(f"{key}: an endpoint appears twice in {value}")
    return endpoints


def process_count(value, key: str) -> int:
    """How many processes ``value`` (a count or an endpoint list) names."""
    listed = parse_endpoints(value, key)
    return len(listed) if listed is not None else int(value)


def endpoints(value, key: str) -> list[str]:
    """The endpoints ``value`` lists, or that many free ports on 127.0.0.1."""
    listed = parse_endpoints(value, key)
    if listed is not None:
        return listed
    return [f"127.0.0.1:{port}" for port in free_ports(int(value))]


def this_host(host: str | None, endpoints: list[str]) -> str:
    """The host whose roles this command starts."""
    hosts = {e.rpartition(":")[0] for e in endpoints}
    host = host or (hosts.pop() if len(hosts) == 1 else None)
    if host is None:
        raise ConfigError(
            "the endpoints name several hosts: set cluster.host to this "
            "host's address, and run the same command on each host"
        )
    return host


def wait_for_listener(host: str, port: int, timeout_s: float, what: str) -> None:
    """Return once ``host:port`` accepts connections, polling every 20 ms; after
    ``timeout_s``, a :class:`ClusterError` saying that ``what`` did not answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise ClusterError(f"{what} did not answer within {timeout_s:.0f} s") from None
            time.sleep(0.02)


#: Linux's ioctl that reads an interface's IPv4 address.
SIOCGIFADDR = 0x8915


def interface_of(host: str) -> str:
    """The name of this machine's network interface that holds ``host``'s IPv4 address
    (``eth0``, ``lo`` ...), or "" where none does (or the system cannot tell).

    Gloo, told no interface, announces the address this machine's name resolves to, which
    many hosts map to a loopback address (``127.0.1.1``, Debian's installer's
    ``/etc/hosts``): the other hosts of a job could not reach it.
    """
    import fcntl
    import struct

    try:
        address = socket.gethostbyname(host) if host else ""
    except OSError:
        return ""
    if not address:
        return ""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                found = fcntl.ioctl(
                    probe.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode())
                )
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(found[20:24]) == address:
                return name
    return ""
