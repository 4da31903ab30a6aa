"""The sync rounds' sum along the workers' chain (kspipe.modes.summing), on loopback:
exactly the sum in worker order, whatever the chunking, and strangers kept out."""

from __future__ import annotations

import hmac
import socket
import threading

import numpy as np
import pytest

from kspipe.cluster import greetings, secret
from kspipe.errors import ConfigError
from kspipe.modes import summing
from tests.kit.strangers import Eavesdropper
from tests.kit.workers import Workers, in_worker_order


@pytest.fixture(autouse=True)
def job_secret(monkeypatch):
    """The secret the kspipe command hands every process of a job."""
    monkeypatch.setenv(secret.SECRET_ENV, "ab" * 32)


def run_workers(count: int, arrays: list, rounds: int = 2, before=None) -> list:
    """Each worker's result of ``rounds`` sums of its array (the last round's)."""
    workers, results, errors = Workers(count), [None] * count, []

    def work(index: int) -> None:
        try:
            chain = summing.WorkerSum(workers.role(index))
            for _ in range(rounds):
                results[index] = chain.sum(arrays[index])
            chain.close()
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    if before is not None:
        before(workers)
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


@pytest.mark.parametrize(
    "count,chunk_bytes,dtype",
    [(2, 1 << 18, "float64"), (5, 1000, "float64"), (7, 8, "float64"), (5, 1000, "float32")],
)
def test_the_chain_sums_in_worker_order_bit_for_bit(monkeypatch, count, chunk_bytes, dtype):
    """Values of very different magnitudes, so that another order of addition gives other
    bits; many chunks and a short last one; summed in the arrays' own dtype (float64 for
    the parameter servers' rounds, float32 for a collective job's gradients)."""
    monkeypatch.setattr(summing, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(count)
    arrays = [
        (rng.standard_normal((37, 11)) * 10.0 ** rng.integers(-8, 8)).astype(dtype)
        for _ in range(count)
    ]
    expected = in_worker_order(arrays)
    assert expected.dtype == dtype
    if count > 2:  # the order shows (two values add alike either way)
        assert not np.array_equal(expected, in_worker_order(arrays[::-1]))
    for result in run_workers(count, arrays):
        assert result.dtype == dtype
        np.testing.assert_array_equal(result, expected)


def greeting(sock: socket.socket, index: int, key: bytes | None = None) -> bytes:
    """The greeting a connector sends as worker ``index`` on ``sock`` (a new connection to
    a listener, whose challenge it reads): with the job's secret, or with ``key``."""
    nonce = greetings.receive(sock, secret.NONCE_BYTES)
    own = secret.nonce()
    if key is None:
        return own + secret.answer(summing.PURPOSE, "connector", str(index), nonce)
    message = f"{summing.PURPOSE}\0connector\0{index}\0".encode() + nonce
    return own + hmac.new(key, message, "sha256").digest()


#: What strangers send a worker's listener: garbage, a greeting of another index, the
#: right index without the secret, an answer of a wrong secret, a huge message, and nothing
#: at all (a connection left open).
STRANGERS = [
    lambda sock, index: b"garbage!",
    lambda sock, index: greeting(sock, index + 5),
    lambda sock, index: bytes(greetings.GREETING_BYTES),
    lambda sock, index: greeting(sock, index, b"not the job's secret"),
    lambda sock, index: b"\xff" * (1 << 20),
    lambda sock, index: b"",
]


def test_strangers_at_a_workers_listener_are_turned_away(monkeypatch, capfd):
    """Connections that do not greet as the worker before in the chain with the job's
    secret are closed, each said in one line; one that sends nothing does not hold the
    worker before out; the chain forms and sums as without them."""
    listening, left_open, visitors = [], [], []
    real_accept_from = summing.accept_from

    def visit(address, index):
        for stranger_says in STRANGERS:
            try:  # the listener closes once the worker before got in
                stranger = socket.create_connection(address, timeout=5.0)
                left_open.append(stranger)
                stranger.sendall(stranger_says(stranger, index))
            except OSError:  # closed, or the huge one: no one reads it all
                pass

    def accept_from(listener, index):
        listening.append(listener.getsockname())
        visiting = threading.Thread(target=visit, args=(listener.getsockname(), index))
        visiting.start()  # while the worker waits for the one before it
        visitors.append(visiting)
        return real_accept_from(listener, index)

    monkeypatch.setattr(summing, "accept_from", accept_from)
    monkeypatch.setattr(summing, "GREETING_TIMEOUT_S", 0.5)
    arrays = [np.full(1000, float(i + 1)) for i in range(3)]
    try:
        for result in run_workers(3, arrays):
            np.testing.assert_array_equal(result, np.full(1000, 6.0))
    finally:
        for visiting in visitors:
            visiting.join(30)
        for stranger in left_open:
            stranger.close()
    assert len(listening) == 2  # workers 1 and 2 each listened, on their own address
    assert all(host == "127.0.0.1" for host, _ in listening)
    refused = [line for line in capfd.readouterr().err.splitlines() if "refused" in line]
    said = "kspipe: refused a connection to the sum's chain"
    assert all(line.startswith(said) for line in refused), refused


def connect_later(address, index: int) -> dict:
    """Worker ``index`` connecting to ``address`` on a thread (it waits for the challenge)."""
    joined: dict = {}

    def join() -> None:
        joined["link"] = summing.connect(address, index)
        joined["link"].sendall(b"after the greeting")

    joined["thread"] = threading.Thread(target=join, daemon=True)
    joined["thread"].start()
    return joined


def test_a_listener_takes_the_worker_before_after_strangers(monkeypatch, capfd):
    """Strangers connected first, the worker before last: the one taken is the worker, and
    each stranger that sent a whole greeting's length is refused in one line."""
    monkeypatch.setattr(summing, "GREETING_TIMEOUT_S", 30.0)

    def say(stranger: socket.socket, says) -> None:
        try:
            stranger.sendall(says(stranger, 0))
        except OSError:  # the huge one: closed once a greeting's length is in
            pass

    with socket.create_server(("127.0.0.1", 0), backlog=summing.GREETING_PEERS) as listener:
        taken: list = []
        listening = threading.Thread(
            target=lambda: taken.append(summing.accept_from(listener, 0)), daemon=True
        )
        listening.start()
        visitors, saying = [], []
        for stranger_says in STRANGERS:
            stranger = socket.create_connection(listener.getsockname(), timeout=5.0)
            visitors.append(stranger)
            saying.append(threading.Thread(target=say, args=(stranger, stranger_says)))
            saying[-1].start()  # each answers the challenge when the listener sends it
        for thread in saying:
            thread.join(10)
        worker = connect_later(listener.getsockname(), 0)
        listening.join(10)
    worker["thread"].join(10)
    with taken[0], worker["link"]:
        assert summing.receive(taken[0], len(b"after the greeting")) == b"after the greeting"
    for stranger in visitors:
        stranger.close()
    err = capfd.readouterr().err
    assert err.count("kspipe: refused a connection to the sum's chain from 127.0.0.1:") == 4, err
    assert err.count("no greeting of the job's") == 4, err  # index 5, no tag, a wrong one, huge
    assert "Traceback" not in err


def test_a_recorded_greeting_is_refused(capfd):
    """A greeting recorded on the way from the worker before to its listener, sent again on
    a connection of its own (in the same job, or a later one with the same secret file),
    answers no new challenge: it is refused in one line, and the worker gets in after it."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        eavesdropper = Eavesdropper(listener.getsockname())
        worker = connect_later(eavesdropper.address, 0)
        summing.accept_from(listener, 0).close()
        worker["thread"].join(10)
        worker["link"].close()
        eavesdropper.close()
    recorded = bytes(eavesdropper.heard[: greetings.GREETING_BYTES])
    assert len(recorded) == greetings.GREETING_BYTES
    with socket.create_server(("127.0.0.1", 0)) as listener:
        replay = socket.create_connection(listener.getsockname(), timeout=10)
        replay.sendall(recorded)
        worker = connect_later(listener.getsockname(), 0)
        taken = summing.accept_from(listener, 0)
        assert greetings.receive(replay, secret.NONCE_BYTES)  # its challenge, then closed
        assert replay.recv(1) == b""
        worker["thread"].join(10)
        taken.settimeout(10)
        assert summing.receive(taken, len(b"after the greeting")) == b"after the greeting"
    for link in (taken, worker["link"], replay):
        link.close()
    err = capfd.readouterr().err
    assert err.count("no greeting of the job's") == 1, err


def test_a_worker_without_the_secret_cannot_greet(monkeypatch):
    monkeypatch.delenv(secret.SECRET_ENV)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with pytest.raises(ConfigError, match=secret.SECRET_ENV):
            summing.connect(listener.getsockname(), 1)


@pytest.mark.parametrize("leaves", ["at once", "after the partial sums"])
def test_a_worker_that_leaves_mid_round_fails_the_round_of_every_other(leaves):
    """The last worker leaves after joining the chain, at once or after taking in every
    partial sum (so its neighbour's round fails only on the way down): the others' round
    fails with an error (a worker left), none waits for ever, though each worker's error
    is kept (and with it the frames that hold its links)."""
    workers, errors = Workers(3), {}

    def work(index: int) -> None:
        chain = summing.WorkerSum(workers.role(index))
        try:
            if index == 2:
                if leaves != "at once":
                    summing.receive_into(chain.previous, np.empty(100_000))
                chain.close()
                return
            chain.sum(np.ones(100_000))
        except Exception as err:  # noqa: BLE001 - what each worker saw
            errors[index] = err

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a worker still waits"
    assert set(errors) == {0, 1}
    assert all(isinstance(e, (summing.ClusterError, OSError)) for e in errors.values())
