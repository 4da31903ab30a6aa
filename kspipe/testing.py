"""A small test kit for kspipe and its plugins: compose configs, build plugin managers,
install plugins and run the command, make tiny data sets and run a tiny pipeline.

    from kspipe.testing import compose_config, tiny_overrides
    cfg = compose_config(["+experiment=omniglot_5way", *tiny_overrides(tmp_path, data)])
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

os.environ.setdefault("GLOG_minloglevel", "2")

from kspipe import hookimpl  # noqa: E402


def compose_config(overrides: list[str] = (), config_dirs: list[str] = (), schemas=None):
    """The config ``kspipe <overrides>`` would run, composed without starting a job.

    It is composed with kspipe's schemas (:func:`kspipe.config.compose`): a value of the
    wrong type or a misspelt key raises :class:`kspipe.errors.ConfigError`.
    """
    from kspipe.config import compose

    return compose(overrides, config_dirs, schemas)


def tiny_omniglot(root: Path, characters: int = 30, drawers: int = 6, seed: int = 0) -> Path:
    """A small Omniglot-layout data set drawn from KanjiVG (cached under ``root``)."""
    from kspipe.fewshot import kanji

    return kanji.ensure(characters=characters, drawers=drawers, seed=seed,
                             cache_dir=str(root), say=lambda message: None)


def tiny_overrides(tmp_path: Path, data_root: Path, train_characters: int = 20) -> list[str]:
    """Overrides that make a run take seconds and write only under ``tmp_path``."""
    return [
        f"dataset.root={data_root}",
        f"dataset.train_characters={train_characters}",
        f"run_dir={tmp_path / 'run'}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "tracking.model=false",  # tests of the MLflow model ask for it
        "model.filters=16",
        "train.meta_iters=4",
        "train.meta_batch=2",
        "train.inner_iters=2",
        "train.shots=3",
        "train.checkpoint_every=2",
        "task.ways=3",
        "task.shots=1",
        "eval.tasks=3",
        "eval.train_tasks=2",
        "eval.inner_iters=2",
        "eval.interval=2",
        "eval.interval_tasks=2",
    ]


def plugin_manager(*plugins, load_entrypoints: bool = False):
    """kspipe's registry with extra ``plugins`` registered (``(name, plugin)`` pairs or objects)."""
    from kspipe.plugin_manager import get_plugin_manager

    pm = get_plugin_manager(load_entrypoints=load_entrypoints)
    for plugin in plugins:
        name, obj = plugin if isinstance(plugin, tuple) else (None, plugin)
        pm.register(obj, name=name)
    pm.check_pending()
    return pm


def install_plugin(site: Path, package: Path, entry_point: str, version: str = "0.1.0") -> None:
    """Install the plugin package folder ``package`` into the folder ``site`` as pip would:
    a copy of it and a dist-info whose entry point ``entry_point`` (``name = module``) is in
    kspipe's group.  :func:`plugin_env` then finds it."""
    import shutil

    shutil.copytree(package, site / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    info = site / f"{package.name}-{version}.dist-info"
    info.mkdir()
    name = package.name.replace("_", "-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[kspipe]\n{entry_point}\n")


def plugin_env(site: Path) -> dict:
    """The environment of a ``kspipe`` command that loads the plugins installed in ``site``."""
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("KSPIPE_DISABLE_PLUGIN_AUTOLOAD", None)
    return env


def run_kspipe(*args: str, cwd, env: dict | None = None, timeout: float = 600):
    """``kspipe <args>`` in a process of its own, in ``cwd``; its ``CompletedProcess``
    (text output captured)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "kspipe.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


class QuietReporter:
    """A reporter that shows nothing, for a stage or learner called outside a run."""

    run_dir = ""

    def progress(self, *args, **kwargs) -> None:
        pass

    def say(self, message: str) -> None:
        pass

    def metrics(self, *args, **kwargs) -> None:
        pass

    def artifact(self, *args, **kwargs) -> None:
        pass


class HookRecorder:
    """A plugin that records every lifecycle hook call, to assert what a run reported."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def metrics(self) -> dict:
        """Every metric logged, last value wins."""
        out: dict = {}
        for name, kwargs in self.calls:
            if name == "kspipe_log_metrics":
                out.update(kwargs["metrics"])
        return out

    @hookimpl
    def kspipe_check_config(self, cfg):
        self.calls.append(("kspipe_check_config", {}))

    @hookimpl
    def kspipe_run_start(self, cfg, role, run_dir):
        self.calls.append(("kspipe_run_start", {"role": role, "run_dir": run_dir}))

    @hookimpl
    def kspipe_progress(self, task, step, total, values):
        self.calls.append(("kspipe_progress", {"task": task, "step": step, "total": total}))

    @hookimpl
    def kspipe_log_metrics(self, metrics, step):
        self.calls.append(("kspipe_log_metrics", {"metrics": dict(metrics), "step": step}))

    @hookimpl
    def kspipe_log_artifact(self, path, artifact_path):
        self.calls.append(("kspipe_log_artifact", {"path": path, "artifact_path": artifact_path}))

    @hookimpl
    def kspipe_before_stage(self, stage, cfg):
        self.calls.append(("kspipe_before_stage", {"stage": stage}))

    @hookimpl
    def kspipe_after_stage(self, stage, cfg, result):
        self.calls.append(("kspipe_after_stage", {"stage": stage}))

    @hookimpl
    def kspipe_on_stage_error(self, stage, cfg, error):
        self.calls.append(("kspipe_on_stage_error", {"stage": stage, "error": error}))

    @hookimpl
    def kspipe_run_end(self, cfg, metrics, run_dir):
        self.calls.append(("kspipe_run_end", {"metrics": dict(metrics)}))

    @hookimpl
    def kspipe_run_error(self, cfg, error):
        self.calls.append(("kspipe_run_error", {"error": error}))


@contextlib.contextmanager
def overloaded(processes: int = 3, seconds: int = 600):
    """More busy processes than a 2-core machine has cores, while the block runs; each is
    ended when the block ends, and by itself after ``seconds`` at the latest."""
    import subprocess
    import sys

    spin = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(processes)]
    try:
        yield
    finally:
        for p in busy:
            p.kill()
            p.wait()


SLURM_CONF = """ClusterName=kspipe
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
#: One node: this host, 8 CPUs.  Several: nodes ``node1``, ``node2`` ... of 4 CPUs each, all
#: this host, each its own slurmd at a loopback address of its own (127.0.0.<i>).
ONE_NODE = "NodeName={host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN"
NODE = ("NodeName={name} NodeHostname={host} NodeAddr=127.0.0.{number} Port={port} CPUs=4 "
        "State=UNKNOWN")
SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "salloc", "sinfo", "scontrol")


def slurm_missing() -> str | None:
    """Why a one-node Slurm cannot be started here, or None."""
    import shutil

    missing = [p for p in SLURM_PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing; README: Slurm)"
    if os.geteuid() != 0:
        return "a one-node Slurm runs its daemons as root"
    return None


@contextlib.contextmanager
def local_slurm(folder: Path, nodes: int = 1):
    """A Slurm cluster on loopback, configured under ``folder`` (nothing in /etc); yields
    the environment its commands need (``SLURM_CONF``).  Its daemons are stopped at the end.

    One node is this host with 8 CPUs, so that small jobs' steps run side by side.  With
    ``nodes`` > 1, each node (``node1``, ``node2`` ...) is a slurmd of its own on this host,
    at an address of its own (127.0.0.1, 127.0.0.2 ...), as a cluster of several machines
    looks to a job: its node list, each node's ``NodeAddr``, steps placed on a node."""
    import socket
    import subprocess
    import time

    from kspipe.endpoints import free_ports

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "state").mkdir(exist_ok=True)
    host = socket.gethostname()
    ctld_port, slurmd_port, *ports = free_ports(2 + nodes)
    names = [host] if nodes == 1 else [f"node{i + 1}" for i in range(nodes)]
    lines = [ONE_NODE.format(host=host)] if nodes == 1 else [
        NODE.format(name=name, host=host, number=i + 1, port=port)
        for i, (name, port) in enumerate(zip(names, ports))]
    conf = folder / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, folder=folder, ctld_port=ctld_port,
                                      slurmd_port=slurmd_port, nodes="\n".join(lines),
                                      names=",".join(names)))
    env = {"SLURM_CONF": str(conf)}
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    munge_pid = folder / "munged.pid"
    try:
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode:
            subprocess.run(["munged", "--force", f"--pid-file={munge_pid}"], check=True,
                           capture_output=True)
        subprocess.run(["slurmctld", "-f", str(conf)], check=True, capture_output=True)
        for name in names:
            subprocess.run(["slurmd", "-f", str(conf), "-N", name], check=True,
                           capture_output=True)
        deadline = time.monotonic() + 60
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=dict(os.environ, **env),
                                   capture_output=True, text=True).stdout.strip()
            if state == "idle":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local Slurm did not come up (sinfo: {state!r}); "
                                   f"logs in {folder}")
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=dict(os.environ, **env),
                       capture_output=True)
        for pid_file in [*(folder / f"slurmd-{name}.pid" for name in names),
                         folder / "slurmctld.pid", munge_pid]:
            stop_daemon(pid_file)


def stop_daemon(pid_file: Path, grace_s: float = 10.0) -> None:
    """SIGTERM to the daemon ``pid_file`` names, if any; SIGKILL if it is still there after
    ``grace_s``."""
    import time

    try:
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return
        if "\nState:\tZ" in status:  # exited; its parent has yet to reap it
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
