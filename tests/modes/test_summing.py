"""The sync rounds' sum along the workers' chain (kspipe.modes.summing), on loopback:
exactly the sum in worker order, whatever the chunking, and strangers kept out."""

from __future__ import annotations

import hmac
import socket
import threading

import numpy as np
import pytest

from kspipe.cluster import secret
from kspipe.errors import ConfigError
from kspipe.modes import summing
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


#: What strangers send a worker's listener: garbage, a greeting of another index (its tag
#: too), the right index without the secret, a tag of a wrong secret, a huge message, and
#: nothing at all (a connection left open).
def strangers(index: int) -> list:
    wrong = hmac.new(b"not the job's secret", f"chain\0{index}".encode(), "sha256").digest()
    return [
        b"garbage!",
        summing.hello(index + 5),
        summing.HELLO.pack(index, bytes(32)),
        summing.HELLO.pack(index, wrong),
        b"\xff" * (1 << 20),
        b"",
    ]


def test_strangers_at_a_workers_listener_are_turned_away(monkeypatch, capfd):
    """Connections that do not greet as the worker before in the chain with the job's tag
    are closed, each said in one line; one that sends nothing does not hold the worker
    before out; the chain forms and sums as without them."""
    listening, left_open, visitors = [], [], []
    real_accept_from = summing.accept_from

    def visit(address, index):
        for greeting in strangers(index):
            try:  # the listener closes once the worker before got in
                stranger = socket.create_connection(address, timeout=5.0)
                left_open.append(stranger)
                stranger.sendall(greeting)
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


def test_a_listener_takes_the_worker_before_after_strangers(monkeypatch, capfd):
    """Strangers connected first, the worker before last: the one taken is the worker, and
    each stranger that sent a whole greeting's length is refused in one line."""
    monkeypatch.setattr(summing, "GREETING_TIMEOUT_S", 30.0)
    with socket.create_server(("127.0.0.1", 0), backlog=summing.GREETING_PEERS) as listener:
        visitors = []
        for greeting in strangers(0):
            stranger = socket.create_connection(listener.getsockname(), timeout=1.0)
            visitors.append(stranger)
            try:
                stranger.sendall(greeting)
            except OSError:  # the huge one: no one reads it all
                pass
        worker = socket.create_connection(listener.getsockname())
        worker.sendall(summing.hello(0) + b"after the greeting")
        taken = summing.accept_from(listener, 0)
    with taken, worker:
        assert summing.receive(taken, len(b"after the greeting")) == b"after the greeting"
    for stranger in visitors:
        stranger.close()
    err = capfd.readouterr().err
    assert err.count("kspipe: refused a connection to the sum's chain from 127.0.0.1:") == 4, err
    assert err.count("not the job's worker 0") == 4, err  # index 5, no tag, a wrong one, huge
    assert "Traceback" not in err


def test_a_worker_without_the_secret_cannot_greet(monkeypatch):
    monkeypatch.delenv(secret.SECRET_ENV)
    with pytest.raises(ConfigError, match=secret.SECRET_ENV):
        summing.hello(1)


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
