"""The address book where a parameter-server job's processes meet for fleet's gloo.

A key-value store over HTTP, as gloo's HTTP client speaks it: ``PUT /<world>/<key>``
keeps a value, ``GET`` returns it (404 until it is put).  Server 0 runs it as a child
process (``python -m kspipe.cluster.addresses <port> <host>``): gloo's set-up holds the Python
interpreter's lock, so a thread of server 0 could not answer while server 0 itself meets
the others.  The book says ``ready`` once it holds its port, and serves until its standard
input closes, which happens when server 0 ends, however it ends.  See
:mod:`kspipe.cluster.meeting`.
"""

from __future__ import annotations

import http.server
import socket
import sys
import threading

from kspipe.cluster.endpoints import interface_of


class AddressBook(http.server.ThreadingHTTPServer):
    """The store, on ``port`` of ``address`` ("": every interface of this host)."""

    daemon_threads = True

    def __init__(self, port: int, address: str = ""):
        super().__init__((address, port), Pages)
        self.values: dict[str, bytes] = {}
        self.lock = threading.Lock()


class Pages(http.server.BaseHTTPRequestHandler):
    server: AddressBook

    def do_PUT(self):
        value = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.server.lock:
            self.server.values[self.path] = value
        self.answer(200)

    def do_GET(self):
        with self.server.lock:
            value = self.server.values.get(self.path)
        if value is None:
            self.answer(404)
        else:
            self.answer(200, value)

    def do_DELETE(self):  # a member done with its key: the others may still need it
        self.answer(200)

    def answer(self, code: int, body: bytes = b"") -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


def serve(port: int, host: str = "") -> int:
    """Serve the book on ``port`` until standard input closes: on ``host``'s address where
    this machine holds it (the job's own address), else on every interface (a name the
    machine resolves elsewhere, say to a loopback address, would leave the others out)."""
    try:
        book = AddressBook(port, socket.gethostbyname(host) if interface_of(host) else "")
    except OSError as err:
        print(
            f"kspipe: error: the gloo meeting point cannot take port {port}: {err.strerror}",
            file=sys.stderr,
        )
        return 1
    threading.Thread(target=book.serve_forever, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.buffer.read()  # returns when the process that started the book ends
    return 0


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), *sys.argv[2:3]))
