"""One worker of bench_scale.py's sync rounds, run in a host of the emulated network.

    python bench/sum_worker.py <index> <addresses,...> <floats> <rounds> <chain|REV|shards|gloo>
    python bench/sum_worker.py serve <server> <floats>

Worker ``index`` of ``len(addresses)`` sums an array of ``floats`` float64 values with the
others ``rounds`` times through kspipe's ``WorkerSum`` (``chain``: this checkout's;
a git revision: that revision's ``kspipe/modes/summing.py``, e.g. the hub it replaced), its
sync rounds' sum (``shards``: the chain and the servers' shard summers,
kspipe/modes/ps/sharded.py) or Paddle's gloo (``gloo``: a program of one ``c_allreduce_sum``
over the gloo world the collective mode's CPU ops use, :class:`GlooSum`), after one round
that is not timed, and prints one JSON line: the seconds of each timed round, their
wall-clock window and this process's CPU time in it, and a digest of the last sum (every
worker must print the same; with ``SUM_SAVE`` set, worker 0 also saves its last sum there,
a ``.npy``).  ``serve``: server ``server`` starts its shard summer and keeps it until its
standard input closes.  Both find the servers' addresses in ``SUM_SERVERS`` (comma
separated) and the job's meeting point as kspipe's processes do (``PADDLE_GLOO_*``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import struct
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GATHER_PORT = 7099  # worker 0's, for the workers' one all_gather (the ports they listen on)
BOOK_PORT = 7098  # worker 0's, gloo's meeting point (``gloo``)
WORD = struct.Struct("!q")
PAIR = struct.Struct("!qq")  # a worker's index and its value


def summing_module(which: str):
    """This checkout's summing module, or a revision's (loaded from git into a module)."""
    if which == "chain":
        sys.path.insert(0, ROOT)
        from kspipe.modes import summing

        return summing
    source = subprocess.run(
        ["git", "-C", ROOT, "show", f"{which}:kspipe/modes/summing.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    sys.path.insert(0, ROOT)
    spec = importlib.util.spec_from_loader(f"summing_{which}", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"{which}:kspipe/modes/summing.py", "exec"), module.__dict__)
    return module


class Role:
    """What WorkerSum asks of its role; ``all_gather`` meets at worker 0's gather port."""

    def __init__(self, index: int, addresses: list[str], server: int = -1):
        self.index, self.addresses, self.server = index, addresses, server
        self.servers = [a for a in os.environ.get("SUM_SERVERS", "").split(",") if a]

    def is_server(self) -> bool:
        return self.server >= 0

    def server_index(self) -> int:
        return self.server

    def get_pserver_endpoints(self) -> list[str]:
        return [f"{a}:7500" for a in self.servers]

    def worker_index(self) -> int:
        return self.index

    def worker_num(self) -> int:
        return len(self.addresses)

    def get_trainer_endpoints(self) -> list[str]:
        return [f"{a}:{7000 + i}" for i, a in enumerate(self.addresses)]

    def all_gather(self, value: int) -> list[int]:
        count = len(self.addresses)
        if self.index == 0:
            values = [value] + [0] * (count - 1)
            with socket.create_server((self.addresses[0], GATHER_PORT), backlog=count) as s:
                peers = []
                for _ in range(count - 1):
                    peer, _ = s.accept()
                    index, peer_value = PAIR.unpack(receive(peer, PAIR.size))
                    values[index] = peer_value
                    peers.append(peer)
                for peer in peers:
                    peer.sendall(b"".join(WORD.pack(v) for v in values))
                    peer.close()
            return values
        deadline = time.monotonic() + 60
        while True:
            try:
                link = socket.create_connection((self.addresses[0], GATHER_PORT), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with link:
            link.sendall(PAIR.pack(self.index, value))
            data = receive(link, WORD.size * count)
        return [WORD.unpack(data[i : i + WORD.size])[0] for i in range(0, len(data), WORD.size)]


def receive(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("a worker left")
        data += chunk
    return data


class GlooSum:
    """``sum(array)`` through Paddle's gloo ring all-reduce: the world the collective mode
    makes on CPU (:func:`kspipe.cluster.meeting.gloo_context`, worker 0 serving its meeting
    point) and its op (``c_allreduce_sum`` on ring 0, whose CPU kernel calls gloo's
    ``allreduce``), in a program built once; a round sets the array into the program's
    variable, runs it and reads the sum back, as a role's ``all_reduce_worker`` does."""

    def __init__(self, index: int, addresses: list[str], floats: int):
        sys.path.insert(0, ROOT)
        import paddle

        from kspipe.cluster.meeting import gloo_context
        from kspipe.modes.collective import reduce_program

        paddle.enable_static()
        os.environ["PADDLE_CURRENT_ENDPOINT"] = f"{addresses[index]}:{7000 + index}"
        self.context, self.book = gloo_context(index, len(addresses), f"{addresses[0]}:{BOOK_PORT}")
        self.program = reduce_program({"value": ((floats,), "float64")}, "c_allreduce_sum")
        self.scope, self.place = paddle.static.Scope(), paddle.CPUPlace()
        self.executor = paddle.static.Executor(self.place)

    def sum(self, values: np.ndarray) -> np.ndarray:
        tensor = self.scope.var("value").get_tensor()
        tensor.set(values, self.place)
        self.executor.run(self.program, scope=self.scope)
        return np.array(tensor)

    def close(self) -> None:
        self.context.barrier()  # worker 0 keeps the meeting point until every worker is done


def serve(server: int, floats: int) -> None:
    sys.path.insert(0, ROOT)
    from kspipe.modes.ps import sharded

    workers = os.environ["SUM_WORKERS"].split(",")
    summer = sharded.start_summer(Role(-1, workers, server), floats)
    sys.stdin.read()
    if summer is not None:
        summer.stdin.close()
        summer.wait()


def main(argv: list[str]) -> None:
    if argv[0] == "serve":
        serve(int(argv[1]), int(argv[2]))
        return
    index, addresses, floats, rounds, which = (
        int(argv[0]),
        argv[1].split(","),
        int(argv[2]),
        int(argv[3]),
        argv[4],
    )
    if which == "shards":
        sys.path.insert(0, ROOT)
        from kspipe.modes.ps import sharded

        chain = sharded.worker_sum(Role(index, addresses), floats)
    elif which == "gloo":
        chain = GlooSum(index, addresses, floats)
    else:
        chain = summing_module(which).WorkerSum(Role(index, addresses))
    values = np.random.default_rng(index).standard_normal(floats)
    chain.sum(values)  # not timed: the links' first bytes, the pages of the buffers
    seconds, started, cpu = [], time.time(), time.process_time()
    for _ in range(rounds):
        started = time.perf_counter()
        total = chain.sum(values)
        seconds.append(time.perf_counter() - started)
    ended, cpu = time.time(), time.process_time() - cpu
    chain.close()
    digest = hashlib.sha256(total.tobytes()).hexdigest()[:16]
    if index == 0 and os.environ.get("SUM_SAVE"):
        np.save(os.environ["SUM_SAVE"], total)
    window = {"started": started, "ended": ended, "cpu_s": cpu}
    print(json.dumps({"index": index, "seconds": seconds, "digest": digest, **window}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
