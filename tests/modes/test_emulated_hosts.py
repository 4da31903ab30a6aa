"""A parameter-server job across four emulated hosts (tests.kit.network): each host a
network namespace with an address of its own, linked to one bridge at 1 Gbit/s each way.
One ``kspipe`` launcher per host, as a user runs the job on four machines
(docs/distributed.md, "Across machines"), the workload the tests' own (tests/plugins/bags).

* the job finishes as one MLflow run, with the parameters of the same job run on one host
  over loopback, bit for bit (sync is exact), and leaves nothing: no namespace, link or
  process;
* the emulated network's own promises: links shaped each way, a link it cannot make one
  line with nothing made, and nothing left however its maker ends (returning, raising,
  SIGTERM, Ctrl-C; after SIGKILL, the next network made removes what was left).

Root only: elsewhere the tests are skipped with the reason.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kspipe.testing import begun_store, run_statuses
from tests.kit.network import (
    ALLOWED,
    CONGESTION,
    Network,
    NetworkUnavailable,
    namespaces,
    unavailable,
)

CHECKOUT = Path(__file__).resolve().parents[2]
MBIT = 1000
#: The job (after ``+experiment=bags``): 4 workers, 2 servers, sync, a few dozen rounds.
JOB = [
    "bags.ids=fixed",
    "bags.train_points=2048",
    "bags.epochs=1",
    "mode=pserver",
    "cluster.strategy=sync",
]
SERVER_PORT, WORKER_PORT = 6000, 6100  # every host's ports are free: its network is new
JOB_TIMEOUT_S = 240


#: Root, ``ip`` and ``tc``, and links the kernel makes: else every test here is skipped with
#: the reason (under ``CI=true`` on a machine where they must work, that skip fails).
pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def ours_left(network: Network) -> list[str]:
    """What is left of ``network``: its namespaces, and any link of the machine's own
    network that names one of them (there should never be one)."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return network.namespaces() + [line for line in links.splitlines() if network.name in line]


def processes_of(folder: Path) -> list[str]:
    """The processes whose command line names ``folder`` (the launchers and every role)."""
    out = subprocess.run(["pgrep", "-af", str(folder)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_four_hosts_finish_with_the_parameters_of_one(bags_env, bags_run, tmp_path):
    """Servers on h1 and h2, worker ``i`` on host ``i + 1``; each launcher writes into its
    own run folder, worker 0's host (h1) into the one MLflow store, a file all hosts see.
    The reference: the same job with counts, on one host over loopback (``bags_run``)."""
    _, expected = bags_run("sync-4-workers-2-servers", *JOB, "workers=4", "servers=2")
    kspipe = str(Path(sys.executable).with_name("kspipe"))
    # names=False: each host's name resolves as the machine's own does (here to loopback),
    # as on hosts whose /etc/hosts maps it so; the job must still meet (gloo's interface)
    with Network(hosts=4, mbit=MBIT, names=False) as network:
        hosts = network.hosts
        servers = ",".join(f"{h.address}:{SERVER_PORT}" for h in hosts[:2])
        workers = ",".join(f"{h.address}:{WORKER_PORT}" for h in hosts)
        logs, launchers = {}, {}
        for host in hosts:
            logs[host.name] = tmp_path / f"{host.name}.out", tmp_path / f"{host.name}.err"
            with open(logs[host.name][0], "w") as out, open(logs[host.name][1], "w") as err:
                launchers[host.name] = host.popen(
                    [
                        kspipe,
                        "+experiment=bags",
                        *JOB,
                        f"servers=[{servers}]",
                        f"workers=[{workers}]",
                        f"cluster.host={host.address}",
                        f"tracking.uri={begun_store(tmp_path)}",
                        f"run_dir={tmp_path / host.name}",
                        f"cluster.timeout_s={JOB_TIMEOUT_S}",
                    ],
                    cwd=tmp_path,
                    env=dict(bags_env, KSPIPE_JOB_SECRET="9d" * 32),  # the same on every host
                    stdout=out,
                    stderr=err,
                )
        deadline = time.monotonic() + JOB_TIMEOUT_S
        for launcher in launchers.values():
            launcher.wait(timeout=max(deadline - time.monotonic(), 1))
    output = {name: (out.read_text(), err.read_text()) for name, (out, err) in logs.items()}
    for name, launcher in launchers.items():
        assert launcher.returncode == 0, (name, output[name][1][-3000:])
    assert "kspipe: done: test_r2" in output["h1"][0]
    for name in ("h2", "h3", "h4"):
        assert f"{hosts[0].address} (worker 0's host) records the run" in output[name][1]
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED"]
    got = dict(np.load(tmp_path / "h1" / "params.npz"))
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert not ours_left(network)
    assert not processes_of(tmp_path)


def send(network: Network, source: int, target: int, megabytes: float) -> float:
    """Seconds ``megabytes`` take over TCP from host ``source`` to host ``target``."""
    address = network.hosts[target].address
    receive = (
        f"import socket\ns = socket.create_server(({address!r}, 7000))\n"
        f"print('listening', flush=True)\nc, _ = s.accept()\n"
        f"while c.recv(1 << 20):\n    pass\n"
    )
    size = int(megabytes * 1e6)
    transmit = (
        f"import socket, time\nc = socket.create_connection(({address!r}, 7000))\n"
        f"t = time.monotonic()\nc.sendall(bytes({size}))\nc.shutdown(socket.SHUT_WR)\n"
        f"c.recv(1)\nprint(time.monotonic() - t)\n"
    )
    receiver = network.hosts[target].popen(
        [sys.executable, "-c", receive], stdout=subprocess.PIPE, text=True
    )
    assert receiver.stdout.readline() == "listening\n"
    sent = network.hosts[source].run(
        [sys.executable, "-c", transmit], capture_output=True, text=True, timeout=60
    )
    receiver.wait(timeout=10)
    assert sent.returncode == 0, sent.stderr
    return float(sent.stdout)


def test_links_carry_their_rate_each_way():
    """2.5 MB at 40 Mbit/s take 0.5 s each way (an unshaped link: milliseconds)."""
    with Network(hosts=2, mbit=40) as network:
        there, back = send(network, 0, 1, 2.5), send(network, 1, 0, 2.5)
    assert there > 0.45 and back > 0.45, (there, back)


def test_hosts_run_the_congestion_control_asked_and_the_machine_keeps_its_list():
    """Every host's TCP runs cubic (Linux's default) whatever the machine's default is; the
    machine's list of allowed ones is what it was once the network is gone."""
    allowed = Path(ALLOWED).read_text()
    with Network(hosts=2, mbit=40) as network:
        for host in network.hosts:
            asked = host.run(["sysctl", "-n", CONGESTION], capture_output=True, text=True)
            assert asked.stdout.strip() == "cubic"
        assert "cubic" in Path(ALLOWED).read_text().split()
    assert Path(ALLOWED).read_text() == allowed or namespaces()  # unless another's is open


def test_a_link_it_cannot_make_is_one_line_and_leaves_nothing():
    network = Network(hosts=2, mbit=1e9)  # a token bucket too large for tc
    with pytest.raises(NetworkUnavailable) as refused:
        network.start()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("cannot make the emulated network: `tc "), message
    assert 'illegal value for "burst"' in message, message
    assert not ours_left(network)


#: A process that makes a network, starts a process in each host, says the network's name
#: and those processes' ids, and then ends as the test's argument says.
MAKER = """
import subprocess, sys, time
from tests.kit.network import Network
network = Network(hosts=2).start()
sleeps = [host.popen(["sleep", "300"]) for host in network.hosts]
print(network.name, *[p.pid for p in sleeps], flush=True)
if sys.argv[1] == "raises":
    raise RuntimeError("a test's failure")
if sys.argv[1] == "waits":
    time.sleep(300)
"""


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def stop_signals_as_a_shell_leaves_them() -> None:
    """SIGINT and SIGTERM neither ignored nor blocked, as a user's shell starts a command
    (the suite's own process may hold them otherwise: its child would inherit that)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


@pytest.mark.parametrize("ends", ["returns", "raises", "SIGTERM", "SIGINT", "SIGKILL"])
def test_nothing_is_left_however_its_maker_ends(ends):
    maker = subprocess.Popen(
        [sys.executable, "-c", MAKER, "waits" if ends.startswith("SIG") else ends],
        cwd=CHECKOUT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=stop_signals_as_a_shell_leaves_them,
    )
    name, *pids = maker.stdout.readline().split()
    assert name.startswith("kspipe-net-") and len(pids) == 2, maker.communicate()
    if ends.startswith("SIG"):
        maker.send_signal(getattr(signal, ends))
    try:
        maker.wait(timeout=30)
    except subprocess.TimeoutExpired:
        status = Path(f"/proc/{maker.pid}/status").read_text().splitlines()
        maker.kill()
        pytest.fail(f"the maker did not end: {[s for s in status if s.startswith('Sig')]}")
    if ends == "SIGKILL":  # nothing cleaned up: the next network made removes it all
        assert len(namespaces(name)) == 3 and all(running(int(pid)) for pid in pids)
        with Network(hosts=1):
            pass
    assert not namespaces(name)
    assert not [pid for pid in pids if running(int(pid))]
