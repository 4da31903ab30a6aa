"""How kspipe's own sockets take the job's peers, and nobody else, without waiting on anyone.

A listener of kspipe's (a worker's end of the sum's chain, a shard summer, the hosts'
control endpoint, the gloo address book) reads what each new connection says first in a
:class:`Lobby`: every connection at once, on one thread, through a selector.  Each has
:data:`PATIENCE_S` to say it, and at most :data:`SEATS` wait at once (the one waiting
longest is closed to make room), so a stranger that says nothing, says it slowly, resets
its connection or keeps connecting delays no one else, holds no thread and leaves one line
in the log (:func:`kspipe.cluster.secret.refused`, no traceback).

A :class:`Door` is a lobby whose first words are a greeting: the listener sends a fresh
random nonce; the connector (:func:`connect`) answers with a nonce of its own and an HMAC
of the job's secret over the socket's purpose, its name and the listener's nonce
(:func:`kspipe.cluster.secret.answer`); the listener, once it knows the name, proves the
same over the connector's nonce.  Both sides' replies are of fixed length: no byte a peer
sends is read as an index, a length or a command, and a greeting recorded on one
connection (or in an earlier job of the same secret) answers no later challenge.
"""

from __future__ import annotations

import collections
import selectors
import socket
import time
from dataclasses import dataclass, field

from kspipe.cluster import secret
from kspipe.errors import ClusterError

#: How long a connection has to say its first words.
PATIENCE_S = 5.0
#: How many connections may be saying them at once.
SEATS = 64
#: A connector's greeting: its nonce, then its answer to the listener's.
GREETING_BYTES = secret.NONCE_BYTES + secret.TAG_BYTES
#: How often a connector tries again when its connection was closed before it got in.
RETRY_S = 0.05


@dataclass(eq=False)
class Guest:
    """A connection while it says its first words."""

    sock: socket.socket
    address: tuple | None
    until: float  # when its patience ends
    said: bytes = b""  # what the listener sent it on arrival (a nonce)
    got: bytes = field(default=b"")  # what it has said so far


class Lobby:
    """New connections to ``listener`` (bound and listening; it is made non-blocking) while
    they say their first words, all at once on the thread that calls :meth:`next`.
    ``wanted(got)``: how many bytes the first words take, given what has come (None: not
    known yet, up to ``most``); ``welcome()``: what a connection is sent on arrival."""

    def __init__(
        self,
        listener: socket.socket,
        what: str,
        wanted,
        most: int,
        welcome=None,
        seats: int = SEATS,
        patience_s: float = PATIENCE_S,
    ):
        self.listener, self.what = listener, what
        self.wanted, self.most, self.welcome = wanted, most, welcome
        self.seats, self.patience_s = seats, patience_s
        self.waiting: dict[socket.socket, Guest] = {}  # in the order they came
        self.heard: collections.deque = collections.deque()  # first words in, not yet taken
        listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)

    def next(self, timeout_s: float | None = None) -> Guest | None:
        """The next connection whose first words are in (its socket blocking again, with no
        timeout), or None once ``timeout_s`` passed.  OSError once the listener is closed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self.listener.fileno() < 0:
                raise OSError(f"{self.what} was closed")
            if self.heard:
                return self.heard.popleft()
            now = time.monotonic()
            for guest in [g for g in self.waiting.values() if g.until <= now]:
                self.refuse(guest, "nothing said in time")
            if deadline is not None and now >= deadline:
                return None
            wait = 1.0  # a closed listener is seen within a second
            if self.waiting:
                wait = min(wait, next(iter(self.waiting.values())).until - now)
            if deadline is not None:
                wait = min(wait, deadline - now)
            for key, _ in self.selector.select(max(wait, 0.0)):
                if key.fileobj is self.listener:
                    self._take()
                elif key.fileobj in self.waiting:
                    guest = self._hear(self.waiting[key.fileobj])
                    if guest is not None:
                        return guest

    def _take(self) -> None:
        for _ in range(self.seats):  # the connections come meanwhile, in one go
            try:
                sock, address = self.listener.accept()
            except OSError:  # none left (BlockingIOError), or no file left to take one
                return
            if len(self.waiting) >= self.seats:
                self.refuse(next(iter(self.waiting.values())), "too many connections at once")
            sock.setblocking(False)
            guest = Guest(sock, address, time.monotonic() + self.patience_s)
            self.waiting[sock] = guest
            self.selector.register(sock, selectors.EVENT_READ)
            if self.welcome is not None:
                guest.said = self.welcome()
                try:  # a new connection's buffer takes a few bytes at once
                    sent = sock.send(guest.said)
                except OSError:
                    sent = 0
                if sent < len(guest.said):
                    self.refuse(guest, "closed on arrival")
                    continue
            heard = self._hear(guest)  # words already there are heard before any later
            if heard is not None:  # arrival can take its seat
                self.heard.append(heard)

    def _hear(self, guest: Guest) -> Guest | None:
        wanted = self.wanted(guest.got)
        try:
            part = guest.sock.recv((wanted or self.most) - len(guest.got))
        except BlockingIOError:
            return None
        except OSError:  # reset
            part = b""
        if not part:
            self.refuse(guest, "closed before it said anything of the job's")
            return None
        guest.got += part
        wanted = self.wanted(guest.got)
        if wanted is None and len(guest.got) >= self.most:
            self.refuse(guest, f"more than {self.most} bytes of first words")
            return None
        if wanted is None or len(guest.got) < wanted:
            return None
        self._leave(guest)
        guest.sock.setblocking(True)
        return guest

    def _leave(self, guest: Guest) -> None:
        del self.waiting[guest.sock]
        self.selector.unregister(guest.sock)

    def refuse(self, guest: Guest, why: str) -> None:
        """Close ``guest``'s connection, said in one line of the log (first: the line is
        there when the peer sees its connection closed)."""
        if guest.sock in self.waiting:
            self._leave(guest)
        secret.refused(self.what, guest.address, why)
        guest.sock.close()

    def close(self) -> None:
        """Close the listener and every connection still waiting (quietly: the listener's
        work is done)."""
        for sock in list(self.waiting):
            self.selector.unregister(sock)
            sock.close()
        self.waiting.clear()
        for guest in self.heard:
            guest.sock.close()
        self.heard.clear()
        self.selector.close()
        self.listener.close()


class Door:
    """A listener that takes connections which answer its challenge as one of ``names``
    (who may still come in: a caller removes one that came)."""

    def __init__(
        self,
        listener: socket.socket,
        purpose: str,
        names,
        what: str,
        seats: int = SEATS,
        patience_s: float = PATIENCE_S,
    ):
        self.purpose, self.names = purpose, set(names)
        self.lobby = Lobby(
            listener,
            what,
            lambda got: GREETING_BYTES,
            GREETING_BYTES,
            secret.nonce,
            seats,
            patience_s,
        )

    def next(self, timeout_s: float | None = None, admit=None) -> tuple | None:
        """``(name, socket)`` of the next connection that greeted as one of :attr:`names`,
        once this side's proof is sent; None once ``timeout_s`` passed.  ``admit(name,
        socket)``: called before the proof goes, so the peer, once in, is known here."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            guest = self.lobby.next(left)
            if guest is None:
                return None
            name = self.greeted_as(guest)
            if name is None:
                self.lobby.refuse(guest, "no greeting of the job's (or from a peer already in)")
                continue
            theirs = guest.got[: secret.NONCE_BYTES]
            if admit is not None:
                admit(name, guest.sock)
            try:
                guest.sock.settimeout(self.lobby.patience_s)
                guest.sock.sendall(secret.answer(self.purpose, "listener", name, theirs))
                guest.sock.settimeout(None)
            except OSError:
                self.lobby.refuse(guest, "closed before it took this side's proof")
                continue
            return name, guest.sock

    def greeted_as(self, guest: Guest) -> str | None:
        """The name whose answer to this connection's challenge ``guest`` sent, if any."""
        got = guest.got[secret.NONCE_BYTES :]
        for name in sorted(self.names):
            if secret.matches(got, secret.answer(self.purpose, "connector", name, guest.said)):
                return name
        return None

    def close(self) -> None:
        self.lobby.close()


def connect(address: tuple, purpose: str, name: str, what: str, timeout_s: float):
    """A connection to the :class:`Door` of ``purpose`` at ``address``, greeted as
    ``name``; tried again while it is refused or closed (a listener not yet listening,
    or too busy), until ``timeout_s`` passed (then the last OSError).  A ClusterError when
    the listener cannot prove it knows the job's secret."""
    secret.current()  # a process without the job's secret stops here, in one line
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(RETRY_S)
            continue
        try:
            introduce(sock, purpose, name, what, max(0.1, deadline - time.monotonic()))
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(RETRY_S)
        except BaseException:
            sock.close()
            raise


def introduce(sock: socket.socket, purpose: str, name: str, what: str, timeout_s: float):
    """Greet the :class:`Door` at the other end of ``sock`` (a new connection) as ``name``:
    answer its challenge, then check its proof over this side's own nonce."""
    sock.settimeout(timeout_s)
    challenge = receive(sock, secret.NONCE_BYTES)
    own = secret.nonce()
    sock.sendall(own + secret.answer(purpose, "connector", name, challenge))
    proof = receive(sock, secret.TAG_BYTES)
    if not secret.matches(proof, secret.answer(purpose, "listener", name, own)):
        peer = "%s:%d" % sock.getpeername()[:2]
        raise ClusterError(f"{what} at {peer} does not know the job's secret")
    sock.settimeout(None)


def receive(sock: socket.socket, size: int) -> bytes:
    """The next ``size`` bytes from ``sock`` (ConnectionError if it closes first)."""
    got = b""
    while len(got) < size:
        part = sock.recv(size - len(got))
        if not part:
            raise ConnectionError("closed")
        got += part
    return got
