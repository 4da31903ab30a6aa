"""The address book where a job's processes meet for gloo.

A key-value store over HTTP, as gloo's HTTP client speaks it: ``PUT /<prefix>_<world>/<rank>``
keeps a value, ``GET`` returns it (404 until it is put).  The first process runs it as a
child process (``python -m kspipe.cluster.addresses <port> <host> <members>``): gloo's set-up
holds the Python interpreter's lock, so a thread of that process could not answer while it
meets the others.  The book says ``ready`` once it holds its port, and serves until its
standard input closes, which happens when its starter ends, however it ends.  See
:mod:`kspipe.cluster.meeting`.

Only the job's processes get in.  Gloo's client sends no credential, but Paddle lets a
world's keys have a prefix: kspipe's is a token made from the job's secret
(:func:`kspipe.cluster.secret.token`), and the book answers only paths of that prefix, one
of the three worlds and a rank below ``members``, with a value of at most
:data:`VALUE_BYTES`; any other request is refused (403, 413) and said in one line of the
log.  Requests are read from every connection at once on one thread
(:class:`kspipe.cluster.greetings.Lobby`), each with :data:`REQUEST_TIMEOUT_S` to arrive
whole and at most :data:`greetings.SEATS` at once, then answered at once from memory: a
stranger that is silent, slow or resets its connection holds no thread, delays no
member, and costs one line of the log.

Paddle's CPU collective world (``GlooParallelContext``) takes no prefix: each of its
members reaches the book through a relay of its own on loopback
(``python -m kspipe.cluster.addresses relay <host> <port> <rank>``), which adds it and
puts that member's own key alone.
"""

from __future__ import annotations

import http.client
import http.server
import io
import re
import socket
import sys
import threading

from kspipe.cluster import greetings, secret
from kspipe.cluster.endpoints import interface_of

#: The largest value a key may hold (gloo's addresses are 136 bytes).
VALUE_BYTES = 4096
#: The longest request line and headers the book reads (gloo's are a few dozen bytes).
HEAD_BYTES = 1 << 14
#: How long a connection may take to send its request, and to take its answer.
REQUEST_TIMEOUT_S = 5.0
ANSWER_TIMEOUT_S = 5.0
WORLDS = ("worker", "server", "all", "summer")  # summer: a shard summer's port (modes/ps)
WHAT = "the gloo meeting point"


class Reception:
    """An HTTP server of one request a connection, each read whole in a lobby and answered
    by ``handler`` (a :class:`Prefetched`) on the serving thread, on ``address``."""

    def __init__(self, address: tuple, handler):
        self.handler = handler
        self.socket = socket.create_server(address, backlog=128)
        self.server_address = self.socket.getsockname()
        self.lobby = greetings.Lobby(
            self.socket, WHAT, request_bytes, HEAD_BYTES, patience_s=REQUEST_TIMEOUT_S
        )
        self._stop, self._stopped = threading.Event(), threading.Event()

    def serve_forever(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    guest = self.lobby.next(0.5)
                except OSError:  # closed
                    return
                if guest is not None:
                    self.answer(guest)
        finally:
            self._stopped.set()

    def answer(self, guest: greetings.Guest) -> None:
        guest.sock.settimeout(ANSWER_TIMEOUT_S)
        try:
            self.handler(guest, guest.address, self)
        except Exception as err:  # noqa: BLE001 - a stranger's doing: one line, never a traceback
            secret.refused(WHAT, guest.address, f"no answer taken ({type(err).__name__})")
        finally:
            guest.sock.close()

    def shutdown(self) -> None:
        """Stop serving (returns once the serving loop has ended)."""
        self._stop.set()
        self._stopped.wait()

    def server_close(self) -> None:
        self.lobby.close()


def request_bytes(got: bytes) -> int | None:
    """How long the request whose first bytes are ``got`` is, once its head is in: the head
    and the body its Content-Length names (the head alone if that is not one the book
    takes: the handler then refuses it)."""
    end = re.search(rb"\r?\n\r?\n", got)
    if end is None:
        return None
    found = re.search(rb"\ncontent-length:[ \t]*([0-9]{1,12})[ \t]*\r?\n", got[: end.end()], re.I)
    size = int(found.group(1)) if found else 0
    return end.end() + (size if size <= VALUE_BYTES else 0)


class Prefetched(http.server.BaseHTTPRequestHandler):
    """A request the lobby read whole: parsed from its bytes, answered on its socket."""

    protocol_version = "HTTP/1.0"  # one request a connection

    def setup(self):
        self.connection = self.request.sock
        self.rfile = io.BytesIO(self.request.got)
        self.wfile = self.connection.makefile("wb")


class AddressBook(Reception):
    """The store, on ``port`` of ``address`` ("": every interface of this host), for a job of
    ``members`` processes."""

    def __init__(self, port: int, address: str = "", members: int = 1 << 16):
        super().__init__((address, port), Pages)
        self.values: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.members = members
        self.keys = re.compile(
            rf"/{secret.token('gloo')}_({'|'.join(WORLDS)})/(0|[1-9][0-9]{{0,8}})"
        )

    def holds(self, path: str) -> bool:
        """Whether ``path`` is one of the job's keys."""
        found = self.keys.fullmatch(path)
        return found is not None and int(found.group(2)) < self.members


class Pages(Prefetched):
    server: AddressBook

    def do_PUT(self):
        if not self.allowed():
            return
        size = body_size(self.headers)
        if size is None:
            return self.refuse(413, f"a value of more than {VALUE_BYTES} bytes")
        value = self.rfile.read(size)
        with self.server.lock:
            self.server.values[self.path] = value
        self.answer(200)

    def do_GET(self):
        if not self.allowed():
            return
        with self.server.lock:
            value = self.server.values.get(self.path)
        if value is None:
            self.answer(404)
        else:
            self.answer(200, value)

    def do_DELETE(self):  # a member done with its key: the others may still need it
        if self.allowed():
            self.answer(200)

    def allowed(self) -> bool:
        if self.server.holds(self.path):
            return True
        self.refuse(403, "not one of the job's keys")
        return False

    def refuse(self, code: int, why: str) -> None:
        self.close_connection = True
        self.answer(code)
        secret.refused(WHAT, self.client_address, f"{self.command}: {why}")

    def answer(self, code: int, body: bytes = b"") -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    def log_error(self, format, *args):  # noqa: A002 - a request it could not read
        secret.refused(WHAT, self.client_address, format % args)


def body_size(headers) -> int | None:
    """A request's Content-Length, or None when it is not one the book takes."""
    try:
        size = int(headers.get("Content-Length", 0))
    except ValueError:
        return None
    return size if 0 <= size <= VALUE_BYTES else None


class Relay(Reception):
    """Paddle's CPU collective world's way to the book at ``book`` (host, port) for member
    ``rank``: on loopback, its requests for ``/_worker/<n>`` go on as the job's keys; it
    puts its own key alone."""

    def __init__(self, book: tuple, rank: int):
        super().__init__(("127.0.0.1", 0), Forward)
        self.book, self.own = book, f"/_worker/{rank}"
        self.prefix = "/" + secret.token("gloo")


class Forward(Prefetched):
    server: Relay

    def do_PUT(self):
        self.forward()

    def do_GET(self):
        self.forward()

    def do_DELETE(self):
        self.forward()

    def forward(self) -> None:
        size = body_size(self.headers)
        known = re.fullmatch(r"/_worker/[0-9]{1,9}", self.path)
        if not known or size is None or (self.command != "GET" and self.path != self.server.own):
            self.close_connection = True
            return self.answer(403)
        body = self.rfile.read(size) if self.command == "PUT" else None
        book = http.client.HTTPConnection(*self.server.book, timeout=REQUEST_TIMEOUT_S)
        try:
            book.request(self.command, self.server.prefix + self.path[1:], body=body)
            reply = book.getresponse()
            self.answer(reply.status, reply.read(VALUE_BYTES + 1))
        except OSError:
            self.answer(503)  # gloo asks again
        finally:
            book.close()

    answer = Pages.answer
    log_message = log_error = Pages.log_message


def serve(port: int, host: str = "", members: int = 1 << 16) -> int:
    """Serve the book on ``port`` until standard input closes: on ``host``'s address where
    this machine holds it (the job's own address), else on every interface (a name the
    machine resolves elsewhere, say to a loopback address, would leave the others out)."""
    try:
        address = socket.gethostbyname(host) if interface_of(host) else ""
        book = AddressBook(port, address, members)
    except OSError as err:
        print(
            f"kspipe: error: the gloo meeting point cannot take port {port}: {err.strerror}",
            file=sys.stderr,
        )
        return 1
    return run(book, "ready")


def relay(host: str, port: int, rank: int) -> int:
    """Relay member ``rank``'s requests to the book at ``host:port`` until standard input
    closes; says its own port."""
    server = Relay((host, port), rank)
    return run(server, f"ready {server.server_address[1]}")


def run(server: Reception, ready: str) -> int:
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(ready, flush=True)
    sys.stdin.buffer.read()  # returns when the process that started it ends
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "relay":
        sys.exit(relay(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    sys.exit(serve(int(sys.argv[1]), *sys.argv[2:3], *map(int, sys.argv[3:4])))
