"""Strangers at kspipe's own sockets, as the tests of each socket send them: silent ones,
ones that reset their connections, and an eavesdropper that records what a peer of the job
sends, to replay it; and how many threads a process runs."""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path


def silent(address: tuple, count: int) -> list:
    """``count`` connections to ``address`` that say nothing (close them when done)."""
    return [socket.create_connection(address, timeout=10) for _ in range(count)]


def resetting(address: tuple, count: int, says: bytes = b"") -> None:
    """``count`` connections to ``address`` that each say ``says`` and then reset (RST)."""
    for _ in range(count):
        stranger = socket.create_connection(address, timeout=10)
        if says:
            stranger.sendall(says)
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        stranger.close()


def threads_of(pid: int) -> int:
    """How many threads process ``pid`` runs."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise ValueError(f"no thread count for process {pid}")


class Eavesdropper:
    """A relay between a peer and ``target`` (host, port) that passes on whatever each side
    sends and records what the first connection's peer sent (:attr:`heard`), as someone
    who reads the network would."""

    def __init__(self, target: tuple):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.heard = bytearray()
        self.links: list = []
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self) -> None:
        peer, _ = self.listener.accept()
        onward = socket.create_connection(self.target)
        self.links += [peer, onward]
        threading.Thread(target=self._pass, args=(onward, peer, None), daemon=True).start()
        self._pass(peer, onward, self.heard)

    @staticmethod
    def _pass(source: socket.socket, sink: socket.socket, record) -> None:
        try:
            while part := source.recv(1 << 16):
                if record is not None:
                    record += part
                sink.sendall(part)
        except OSError:
            pass

    def close(self) -> None:
        for link in [self.listener, *self.links]:
            link.close()
