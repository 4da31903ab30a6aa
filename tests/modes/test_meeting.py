"""Where a job's processes meet for gloo: kspipe's address book (kspipe/cluster/addresses.py,
kspipe/cluster/meeting.py).  Every cluster test meets through it; these check the book: it
keeps the job's keys, refuses anyone without the job's secret, and listens on the job's
address."""

import http.client
import socket
import subprocess
import sys
import time

import pytest

from kspipe.cluster import secret
from kspipe.cluster.endpoints import free_ports
from kspipe.cluster.meeting import open_book
from kspipe.errors import ClusterError, ConfigError
from tests.kit.strangers import resetting, silent, threads_of

SECRET = "cd" * 32


@pytest.fixture(autouse=True)
def job_secret(monkeypatch):
    monkeypatch.setenv(secret.SECRET_ENV, SECRET)


@pytest.fixture
def book(tmp_path):
    """A book of a job of 2 processes, as :func:`open_book` starts it, its log kept: its
    port, its log's path, its process id."""
    (port,) = free_ports(1)
    log = open(tmp_path / "book.log", "w")
    started = subprocess.Popen(
        [sys.executable, "-m", "kspipe.cluster.addresses", str(port), "127.0.0.1", "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
    )
    assert started.stdout.readline() == b"ready\n"
    yield port, tmp_path / "book.log", started.pid
    started.stdin.close()  # what the starter's exit does
    assert started.wait(timeout=10) == 0
    log.close()


def key(world: str, rank: int) -> str:
    """A key's path as gloo's HTTP client asks for it, with the job's prefix."""
    return f"/{secret.token('gloo')}_{world}/{rank}"


def ask(port: int, method: str, path: str, body: bytes | None = None, headers=None):
    """The status and body of one request to the book."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def test_the_book_keeps_what_is_put_and_ends_with_its_starter(book):
    book, *_ = book
    assert ask(book, "GET", key("worker", 1))[0] == 404
    assert ask(book, "PUT", key("worker", 1), b"\x00address") == (200, b"")
    assert ask(book, "GET", key("worker", 1)) == (200, b"\x00address")
    assert ask(book, "GET", key("server", 1))[0] == 404  # another world's key is another key


def raw(port: int, data: bytes) -> bytes:
    """What the book answers to ``data`` sent as it is (garbage, a request cut short)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        try:
            client.sendall(data)
            client.shutdown(socket.SHUT_WR)
            return client.recv(1 << 16)
        except OSError:
            return b""


def test_strangers_reach_no_key_and_change_none(book):
    """Requests without the job's prefix (the bare key gloo would ask for, a guessed or
    other job's prefix), a rank beyond the job's members, a value beyond the book's bound,
    garbage: each is refused, said in one line of the log (the first 20), and the job's keys
    stay as put."""
    book, log, _ = book
    assert ask(book, "PUT", key("worker", 0), b"worker 0") == (200, b"")
    other = secret.token("gloo", {secret.SECRET_ENV: "ef" * 32})
    bare, long = ("/worker/0", "/_worker/0"), "/" + "x" * 9000
    for path in (*bare, f"/{other}_worker/0", key("worker", 2), long):
        for method in ("GET", "PUT", "DELETE"):
            assert ask(book, method, path, b"stranger" if method == "PUT" else None)[0] == 403
    assert ask(book, "PUT", key("worker", 1), b"x" * 5000)[0] == 413
    huge = {"Content-Length": str(1 << 40)}
    assert ask(book, "PUT", key("worker", 1), b"", headers=huge)[0] == 413
    assert b"400" in raw(book, b"\x16\x03\x01 garbage\r\n\r\n")
    cut = b"PUT " + key("worker", 0).encode() + b" HTTP/1.0\r\nContent-Length: x\r\n\r\n"
    assert b"413" in raw(book, cut)
    for _ in range(5):  # a flood: 24 refusals in all, the first 20 said
        assert b"400" in raw(book, b"garbage\r\n\r\n")
    assert ask(book, "GET", key("worker", 0)) == (200, b"worker 0")
    assert ask(book, "GET", key("worker", 1))[0] == 404
    err = log.read_text()
    refusals = [line for line in err.splitlines() if "refused" in line]
    assert len(refusals) == 20, err
    said = "kspipe: refused a connection to the gloo meeting point from 127.0.0.1:"
    assert all(line.startswith(said) for line in refusals), refusals
    assert "further refusals are not logged" in refusals[-1]
    assert "Traceback" not in err and SECRET not in err


def test_idle_strangers_hold_no_thread_and_delay_no_member(book):
    """200 connections that say nothing (a thread each, and 180 threads at once, before):
    the book runs no more threads than without them, and answers a member at once."""
    book, log, pid = book
    before = threads_of(pid)
    strangers = silent(("127.0.0.1", book), 200)
    try:
        time.sleep(0.5)
        began = time.monotonic()
        assert ask(book, "PUT", key("worker", 0), b"worker 0") == (200, b"")
        assert ask(book, "GET", key("worker", 0)) == (200, b"worker 0")
        took = time.monotonic() - began
        assert threads_of(pid) <= before, f"{threads_of(pid)} threads, {before} before"
    finally:
        for stranger in strangers:
            stranger.close()
    assert took < 1.0, f"a member waited {took:.1f} s"
    assert "Traceback" not in log.read_text()


def test_strangers_that_reset_their_connections_cost_a_line_each_at_most(book):
    """100 strangers that send the start of a request and reset, and 100 that reset at once
    (before, each of the first printed a traceback of socketserver's: 3,000 lines): no
    traceback, at most one line each (the first 20 said), and the book answers on."""
    book, log, _ = book
    resetting(("127.0.0.1", book), 100, b"GET /" + key("worker", 0).encode())
    resetting(("127.0.0.1", book), 100)
    assert ask(book, "PUT", key("worker", 1), b"worker 1") == (200, b"")
    err = log.read_text()
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) <= secret.LOGGED_REFUSALS, err
    said = "kspipe: refused a connection to the gloo meeting point from 127.0.0.1:"
    assert lines and all(line.startswith(said) for line in lines), lines


def test_a_taken_port_is_one_line():
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ClusterError, match=f"could not take port {port}"):
            open_book("127.0.0.1", port, 2)


def test_a_process_without_the_secret_starts_no_book(monkeypatch):
    monkeypatch.delenv(secret.SECRET_ENV)
    with pytest.raises(ConfigError, match=f"{secret.SECRET_ENV} is not set"):
        open_book("127.0.0.1", free_ports(1)[0], 2)


def test_the_book_listens_on_the_jobs_address_alone(book):
    """Given an address this machine holds, the book takes its port there, not on every
    interface: 127.0.0.2, another of this machine's loopback addresses, is refused."""
    book, *_ = book
    with socket.create_connection(("127.0.0.1", book), timeout=5):
        pass
    with pytest.raises(OSError), socket.create_connection(("127.0.0.2", book), timeout=5):
        pass


#: Two members of Paddle's CPU collective world meet through the book (a relay each).
MEET = """
import sys
from kspipe.cluster.meeting import gloo_context
context, book = gloo_context(int(sys.argv[1]), 2, sys.argv[2])
context.barrier()
print("met", flush=True)
"""


def test_paddles_collective_world_meets_through_relays_among_strangers(capfd):
    """GlooParallelContext takes no key prefix: each member's relay adds the job's, so the
    world meets while a stranger puts garbage under the bare keys it would have used."""
    (port,) = free_ports(1)
    endpoint = f"127.0.0.1:{port}"
    members = [
        subprocess.Popen([sys.executable, "-c", MEET, str(rank), endpoint], stdout=subprocess.PIPE)
        for rank in (0, 1)
    ]
    try:
        for _ in range(200):
            for rank in (0, 1):
                try:
                    ask(port, "PUT", f"/_worker/{rank}", b"\x00" * 136)
                except OSError:  # not yet listening, or gone
                    pass
            if members[1].poll() is not None:
                break
        outputs = [m.communicate(timeout=120)[0] for m in members]
    finally:
        for m in members:
            if m.poll() is None:
                m.kill()
    assert [m.returncode for m in members] == [0, 0]
    assert outputs == [b"met\n", b"met\n"]


def test_a_relay_puts_its_own_members_key_alone(book):
    """A member's relay (of rank 0) adds the job's prefix: it puts rank 0's key and reads
    any member's, and refuses to put another's or a path of its own choosing."""
    book, *_ = book
    relay = subprocess.Popen(
        [sys.executable, "-m", "kspipe.cluster.addresses", "relay", "127.0.0.1", str(book), "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(relay.stdout.readline().split()[1])
        assert ask(port, "PUT", "/_worker/0", b"rank 0") == (200, b"")
        assert ask(book, "GET", key("worker", 0)) == (200, b"rank 0")
        assert ask(port, "PUT", "/_worker/1", b"stranger")[0] == 403
        assert ask(port, "PUT", key("worker", 1), b"stranger")[0] == 403
        assert ask(port, "GET", "/_worker/1")[0] == 404
        assert ask(book, "PUT", key("worker", 1), b"rank 1")[0] == 200
        assert ask(port, "GET", "/_worker/1") == (200, b"rank 1")
    finally:
        relay.stdin.close()
        assert relay.wait(timeout=10) == 0
