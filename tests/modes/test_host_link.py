"""The control link of a job across hosts (kspipe/launchers/hosts.py) keeps strangers out:
only a launcher that greets with the job's secret is one of the job's, and whatever else
connects, before or after the hosts met, changes nothing.  Hosts are 127.0.0.1 and
127.0.0.2, both in this process."""

import hmac
import socket
import subprocess
import sys
import threading
import time

import pytest

from kspipe.cluster import greetings, secret
from kspipe.cluster.endpoints import free_ports
from kspipe.errors import ClusterError
from kspipe.launchers import hosts as hosts_module
from kspipe.launchers.hosts import HostLink, JobHosts
from tests.kit.strangers import Eavesdropper, silent

FIRST, OTHER = "127.0.0.1", "127.0.0.2"


@pytest.fixture(autouse=True)
def job_secret(monkeypatch):
    monkeypatch.setenv(secret.SECRET_ENV, "7a" * 32)
    monkeypatch.setattr(hosts_module, "HELLO_TIMEOUT_S", 0.5)


def answer(sock: socket.socket, host: str, key: bytes | None = None) -> bytes:
    """A connector's greeting as ``host`` on ``sock`` (its challenge read): with the job's
    secret, or with ``key``."""
    nonce = greetings.receive(sock, secret.NONCE_BYTES)
    if key is None:
        return bytes(16) + secret.answer("hosts", "connector", host, nonce)
    message = f"hosts\0connector\0{host}\0".encode() + nonce
    return bytes(16) + hmac.new(key, message, "sha256").digest()


def strangers() -> list:
    """What strangers send: garbage, the other host's old greeting line (no answer to the
    challenge), an answer of another secret, the answer of a host that is not the job's,
    then a failure each (which must not stop the job); a huge line; nothing at all."""
    return [
        lambda sock: b"\x00\xffgarbage\n",
        lambda sock: f"hello {OTHER} {'0' * 64}\nfailed stopped by a stranger\n".encode(),
        lambda sock: answer(sock, OTHER, b"another secret") + b"failed stopped by a stranger\n",
        lambda sock: answer(sock, "127.0.0.9") + b"failed stranger\n",
        lambda sock: b"hello " + b"x" * (1 << 20) + b"\n",
        lambda sock: b"",
    ]


def visit(control: tuple) -> list:
    left_open = []
    for says in strangers():
        stranger = socket.create_connection(control, timeout=2.0)
        left_open.append(stranger)
        try:
            stranger.sendall(says(stranger))
        except OSError:  # the huge line: closed before all of it is read
            pass
    return left_open


def test_strangers_at_the_control_endpoint_change_nothing(capfd):
    (port,) = free_ports(1)
    everyone = frozenset({FIRST, OTHER})
    first = HostLink(JobHosts(FIRST, FIRST, everyone, (FIRST, port)), timeout_s=60)
    other = HostLink(JobHosts(OTHER, FIRST, everyone, (FIRST, port)), timeout_s=60)
    said = []
    first.open(said.append)
    visitors = visit((FIRST, port))  # while the hosts meet
    other.open(said.append)
    visitors += visit((FIRST, port))  # after they met: mid-job
    err, deadline = "", time.monotonic() + 30
    while err.count("refused") < 12 and time.monotonic() < deadline:  # 6 each time
        err += capfd.readouterr().err
        time.sleep(0.1)
    refusals = [line for line in err.splitlines() if "refused" in line]
    try:
        assert len(refusals) == 12, err
        assert all(
            line.startswith(
                f"kspipe: refused a connection to the control endpoint {FIRST}:{port} from "
            )
            for line in refusals
        ), refusals
        assert first.failure() is None and other.failure() is None
        first.close()  # the job done: the other host, its part done, hears it
        assert other.outcome(timeout_s=10) is None
    finally:
        for stranger in visitors:
            stranger.close()
        other.close()
        first.close()


def link_pair(port: int, timeout_s: float = 60) -> tuple:
    everyone = frozenset({FIRST, OTHER})
    first = HostLink(JobHosts(FIRST, FIRST, everyone, (FIRST, port)), timeout_s=timeout_s)
    other = HostLink(JobHosts(OTHER, FIRST, everyone, (FIRST, port)), timeout_s=timeout_s)
    return first, other


def test_idle_strangers_at_the_control_endpoint_hold_no_thread():
    """200 connections that say nothing (a thread each, before, for 10 s): the first host
    runs no thread for them, and the other host still gets in at once."""
    (port,) = free_ports(1)
    first, other = link_pair(port)
    first.open(lambda line: None)
    before = threading.active_count()
    strangers = silent((FIRST, port), 200)
    try:
        time.sleep(0.3)
        assert threading.active_count() <= before, threading.active_count() - before
        began = time.monotonic()
        other.open(lambda line: None)
        took = time.monotonic() - began
        assert took < 1.0, f"the other host got in {took:.1f} s later"
        first.close()
        assert other.outcome(timeout_s=10) is None
    finally:
        for stranger in strangers:
            stranger.close()
        other.close()
        first.close()


def test_a_recorded_greeting_is_refused_by_a_later_job(capfd):
    """The other host's greeting, recorded on its way to the first host, sent to a later
    job's first host of the same secret: it answers no new challenge and is refused."""
    (port,) = free_ports(1)
    first, _ = link_pair(port)
    first.open(lambda line: None)
    eavesdropper = Eavesdropper((FIRST, port))
    other = HostLink(
        JobHosts(OTHER, FIRST, frozenset({FIRST, OTHER}), eavesdropper.address), timeout_s=60
    )
    other.open(lambda line: None)
    first.close()
    assert other.outcome(timeout_s=10) is None
    other.close()
    eavesdropper.close()
    recorded = bytes(eavesdropper.heard[: greetings.GREETING_BYTES])
    (port,) = free_ports(1)
    later, _ = link_pair(port)
    later.open(lambda line: None)
    try:
        with socket.create_connection((FIRST, port), timeout=10) as replay:
            replay.sendall(recorded + b"failed stopped by a replay\n")
            assert greetings.receive(replay, secret.NONCE_BYTES)
            try:
                assert replay.recv(1) == b""  # refused: closed
            except ConnectionResetError:  # refused, with its failure line unread
                pass
        assert later.failure() is None
        assert "kspipe: refused a connection to the control endpoint" in capfd.readouterr().err
    finally:
        later.close()


def test_a_stranger_holding_the_control_port_is_found_out():
    """A stranger listening where the first host's launcher should (it took the port first)
    cannot prove it knows the job's secret: the other host fails in one line rather than
    take orders from it."""
    with socket.create_server((FIRST, 0)) as impostor:
        _, other = link_pair(impostor.getsockname()[1])
        stop = threading.Event()

        def pose() -> None:
            try:
                while not stop.is_set():
                    conn, _ = impostor.accept()
                    with conn:
                        conn.sendall(secret.nonce())
                        conn.recv(1024)
                        conn.sendall(bytes(secret.TAG_BYTES) + b"restart 1 - an order\n")
            except OSError:  # the test is over
                pass

        threading.Thread(target=pose, daemon=True).start()
        with pytest.raises(ClusterError, match="does not know the job's secret"):
            other.open(lambda line: None)
        stop.set()


def test_a_job_across_hosts_without_a_secret_is_refused_before_it_starts(tmp_path):
    """One line, before any process starts or the run is recorded."""
    env = {k: v for k, v in __import__("os").environ.items() if k != secret.SECRET_ENV}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kspipe.cli.command",
            "+experiment=omniglot_5way",
            "mode=pserver",
            f"servers=[{FIRST}:7100]",
            f"workers=[{FIRST}:7103,{OTHER}:7106]",
            f"cluster.host={FIRST}",
            f"run_dir={tmp_path / 'run'}",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("kspipe: error: a job across hosts needs the same secret"), last
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "logs").exists()
