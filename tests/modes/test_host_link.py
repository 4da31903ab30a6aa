"""The control link of a job across hosts (kspipe/launchers/hosts.py) keeps strangers out:
only a launcher that greets with the job's secret is one of the job's, and whatever else
connects, before or after the hosts met, changes nothing.  Hosts are 127.0.0.1 and
127.0.0.2, both in this process."""

import hmac
import socket
import subprocess
import sys
import time

import pytest

from kspipe.cluster import secret
from kspipe.cluster.endpoints import free_ports
from kspipe.launchers import hosts as hosts_module
from kspipe.launchers.hosts import HostLink, JobHosts

FIRST, OTHER = "127.0.0.1", "127.0.0.2"


@pytest.fixture(autouse=True)
def job_secret(monkeypatch):
    monkeypatch.setenv(secret.SECRET_ENV, "7a" * 32)
    monkeypatch.setattr(hosts_module, "HELLO_TIMEOUT_S", 0.5)


def strangers() -> list:
    """What strangers send: garbage, the other host's name without the tag, with a tag of
    another secret, with the tag of a host that is not the job's, then a failure each
    (which must not stop the job); a huge line; nothing at all."""
    wrong = hmac.new(b"another secret", f"hosts\0{OTHER}".encode(), "sha256").hexdigest()
    return [
        b"\x00\xffgarbage\n",
        f"hello {OTHER}\nfailed stopped by a stranger\n".encode(),
        f"hello {OTHER} {wrong}\nfailed stopped by a stranger\n".encode(),
        f"hello 127.0.0.9 {hosts_module.greeting('127.0.0.9')}\nfailed stranger\n".encode(),
        b"hello " + b"x" * (1 << 20) + b"\n",
        b"",
    ]


def visit(control: tuple) -> list:
    left_open = []
    for message in strangers():
        stranger = socket.create_connection(control, timeout=2.0)
        left_open.append(stranger)
        try:
            stranger.sendall(message)
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
            and line.endswith("no job greeting")
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
