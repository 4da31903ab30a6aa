"""The sync rounds' sum shared between the workers' chain and shard summers beside the
servers (kspipe/modes/ps/sharded.py, kspipe/modes/ps/summer.py), on loopback: workers are
threads of this process, each server's summer a real child process, announced through a
real address book: exactly the sum in worker order, and a worker that leaves fails every
other worker's round (strangers: test_summer_strangers.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kspipe.cluster import secret
from kspipe.cluster.addresses import AddressBook
from kspipe.errors import ClusterError
from kspipe.modes import summing
from kspipe.modes.ps import sharded
from tests.kit.summers import Job, a_summer, greeted, start_servers
from tests.kit.workers import in_worker_order


@pytest.fixture(autouse=True)
def job_secret(monkeypatch):
    """The secret the kspipe command hands every process of a job (its summers inherit it)."""
    monkeypatch.setenv(secret.SECRET_ENV, "cd" * 32)


@pytest.fixture
def book(monkeypatch):
    """The job's address book on loopback, named in the environment as Paddle's contract
    names it."""
    book = AddressBook(0, "127.0.0.1")
    threading.Thread(target=book.serve_forever, daemon=True).start()
    monkeypatch.setenv("PADDLE_GLOO_RENDEZVOUS", "3")
    monkeypatch.setenv("PADDLE_GLOO_HTTP_ENDPOINT", f"127.0.0.1:{book.server_address[1]}")
    yield book
    book.shutdown()
    book.server_close()


def run_workers(job: Job, rounds: list, dtype="float64") -> list:
    """Each worker's result of each round (``rounds[r][w]``: worker w's array in round r)."""
    results = [[None] * len(rounds) for _ in range(job.count)]
    errors: list = []

    def work(index: int) -> None:
        try:
            total = sharded.worker_sum(job.role(index), rounds[0][0].size, dtype=dtype)
            assert isinstance(total, sharded.ShardedSum)
            for r, arrays in enumerate(rounds):
                results[index][r] = total.sum(arrays[index])
            total.close()
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(job.count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


def test_the_split_lowers_the_busiest_links_bytes_from_three_workers():
    """The chain's share f balances a middle worker's link, (1 + f) W, with a server's,
    N (1 - f) W / M; two workers keep the chain alone."""
    assert sharded.chain_fraction(2, 1) == sharded.chain_fraction(1, 1) == 1.0
    assert sharded.chain_fraction(16, 8) == pytest.approx(1 / 3)
    assert sharded.chain_fraction(3, 8) == 0.0  # more servers than workers: all on them
    for workers, servers in [(3, 1), (3, 2), (16, 8), (16, 4), (5, 7)]:
        f = sharded.chain_fraction(workers, servers)
        middle, server = 1 + f, workers * (1 - f) / servers
        assert max(middle, server) < 2.0  # the chain alone: 2 W
        assert middle == pytest.approx(server) or f == 0.0
    chain_end, slices = sharded.split(1003, 16, 8)
    assert chain_end == 334 and slices[0] == (334, 418) and slices[-1] == (920, 1003)
    assert [end - start for start, end in slices] == [84] * 5 + [83] * 3
    assert sharded.split(10, 2, 1) == (10, [(10, 10)])


@pytest.mark.parametrize(
    "count,servers,dtype,chunk_bytes",
    [
        (3, 1, "float64", 1 << 15),  # the chain's share 1/2, one summer
        (3, 2, "float64", 64),  # many chunks, a short last one
        (5, 2, "float32", 8),  # a value a chunk; a collective's dtype
        (4, 8, "float64", 1000),  # more servers than workers: no chain, all on summers
    ],
)
def test_the_split_sums_in_worker_order_bit_for_bit(
    monkeypatch, book, summers, count, servers, dtype, chunk_bytes
):
    """Values of very different magnitudes, so that another order of addition gives other
    bits; the chain's chunks and the summers' of several sizes; two rounds of different
    arrays; every worker gets the sum in worker order, in the arrays' dtype."""
    monkeypatch.setattr(summing, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(count * 10 + servers)
    rounds = [
        [
            (rng.standard_normal((37, 11)) * 10.0 ** rng.integers(-8, 8)).astype(dtype)
            for _ in range(count)
        ]
        for _ in range(2)
    ]
    job = Job(count, servers)
    start_servers(job, rounds[0][0].size, summers, dtype, chunk_bytes)
    assert sum(process is not None for process in summers) == servers
    results = run_workers(job, rounds, dtype)
    for r, arrays in enumerate(rounds):
        expected = in_worker_order(arrays)
        assert not np.array_equal(expected, in_worker_order(arrays[::-1]))  # order shows
        for w in range(count):
            assert results[w][r].dtype == dtype and results[w][r].shape == (37, 11)
            np.testing.assert_array_equal(results[w][r], expected, err_msg=f"{w} {r}")


def test_two_workers_or_no_address_book_keep_the_chain_alone(monkeypatch, book, summers):
    job = Job(2, 1)
    start_servers(job, 100, summers)
    assert summers == [None]
    assert sharded.splits(Job(3, 1).role(0), 100)
    monkeypatch.setenv("PADDLE_GLOO_RENDEZVOUS", "2")  # a folder: nowhere to announce
    assert not sharded.splits(Job(3, 1).role(0), 100)


def test_a_worker_slow_to_take_its_totals_holds_back_no_other(summers):
    """Worker 1 of 3 sends its slice and takes none of its totals (its link busy with
    other flows, on a cluster): workers 0 and 2 still get every total, though theirs and
    worker 1's are far more than the links' buffers hold."""
    size = 8_000_000  # 64 MB a worker's totals: many times a loopback link's buffers
    links = greeted(a_summer(summers, 3, size), range(3), timeout_s=60)
    arrays = [np.full(size, float(w + 1)) + np.arange(size) / 7 for w in range(3)]
    sending = [
        threading.Thread(target=links[w].sendall, args=(arrays[w].tobytes(),), daemon=True)
        for w in range(3)
    ]  # each on a thread: the summer reads the workers' slices a chunk at a time, in turn
    for thread in sending:
        thread.start()
    expected = in_worker_order(arrays)
    for w in (0, 2):
        total = np.empty(size)
        summing.receive_into(links[w], total)  # the links' timeout: 60 s
        np.testing.assert_array_equal(total, expected)
    for link in links.values():
        link.close()
    assert summers[0].wait(timeout=30) == 0


@pytest.mark.parametrize("leaves", ["at once", "after its slices", "the server ends"])
def test_a_worker_that_leaves_mid_round_fails_the_round_of_every_other(book, summers, leaves):
    """Worker 2 of 3 (one summer: half the array on the chain) leaves after joining, at
    once or after sending its slice; or server 0 ends: the others' round fails with an
    error, none waits for ever, and the summer ends."""
    job, errors, size = Job(3, 1), {}, 100_000
    start_servers(job, size, summers)
    joined = threading.Barrier(3, timeout=30)

    def work(index: int) -> None:
        total = sharded.worker_sum(job.role(index), size)
        joined.wait()
        try:
            if index == 2 and leaves != "the server ends":
                if leaves == "after its slices":
                    for _, link, start, end in total.links:
                        link.sendall(np.ones(end - start).tobytes())
                total.close()
                return
            if index == 0 and leaves == "the server ends":
                summers[0].stdin.close()
            total.sum(np.ones(size))
        except Exception as err:  # noqa: BLE001 - what each worker saw
            errors[index] = err

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a worker still waits"
    assert set(errors) == ({0, 1, 2} if leaves == "the server ends" else {0, 1})
    assert all(isinstance(e, (ClusterError, OSError)) for e in errors.values()), errors
    summers[0].wait(timeout=30)
