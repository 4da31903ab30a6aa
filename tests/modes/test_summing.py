"""The sync rounds' sum along the workers' chain (kspipe.modes.summing), on loopback:
exactly the sum in worker order, whatever the chunking, and strangers kept out."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from kspipe.modes import summing


class Workers:
    """``count`` workers' roles in threads of this process; ``all_gather`` meets at a
    barrier, as fleet's gloo does."""

    def __init__(self, count: int):
        self.count = count
        self.barrier = threading.Barrier(count, timeout=30)
        self.values: list = [None] * count
        self.endpoints = [f"127.0.0.1:{7000 + i}" for i in range(count)]

    def role(self, index: int):
        workers = self

        class Role:
            def worker_index(self):
                return index

            def worker_num(self):
                return workers.count

            def get_trainer_endpoints(self):
                return list(workers.endpoints)

            def all_gather(self, value):
                workers.values[index] = value
                workers.barrier.wait()
                gathered = list(workers.values)
                workers.barrier.wait()
                return gathered

        return Role()


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


def in_worker_order(arrays: list) -> np.ndarray:
    total = arrays[0].copy()
    for array in arrays[1:]:
        total += array
    return total


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


def test_a_stranger_at_a_workers_listener_is_turned_away(monkeypatch):
    """Connections that do not name the worker before in the chain (garbage, another index)
    are closed; the chain forms and sums as without them."""
    listening = []
    real_accept_from = summing.accept_from

    def accept_from(listener, index):
        listening.append(listener.getsockname())
        for greeting in (b"garbage!", summing.HELLO.pack(index + 5), b"\x00"):
            with socket.create_connection(listener.getsockname()) as stranger:
                stranger.sendall(greeting)
        return real_accept_from(listener, index)

    monkeypatch.setattr(summing, "accept_from", accept_from)
    arrays = [np.full(1000, float(i + 1)) for i in range(3)]
    for result in run_workers(3, arrays):
        np.testing.assert_array_equal(result, np.full(1000, 6.0))
    assert len(listening) == 2  # workers 1 and 2 each listened, on their own address
    assert all(host == "127.0.0.1" for host, _ in listening)


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
