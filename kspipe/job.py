"""The run folder of a command, and of a job whose processes a scheduler started.

kspipe's own launcher starts a job's roles and tells each one its run folder.  A
scheduler (Paddle's launcher, a ``PaddleJob``'s pods, Slurm's ``srun``) starts every
process of a job itself, with Paddle's environment contract (``TRAINING_ROLE``,
``PADDLE_TRAINER_ID``, ``PADDLE_TRAINER_ENDPOINTS`` ...) and the same ``kspipe
<overrides>``.  Such processes start seconds apart and never talk before training, so
they agree on their run folder by naming it after the job: ``outputs/job-<id>``, where
the id is ``cluster.job_id`` if given, else the scheduler's (``PADDLE_JOB_ID``, or
``SLURM_JOB_ID`` with a digest of the command's overrides), else a digest of the job's
endpoint lists (the same in all of its
processes, and different for every job running at once).  One run folder means one
MLflow run: the first worker records it.

Hydra's own files (``.hydra/``, the command's log) go into the run folder too: the
config's ``hydra.run.dir`` is :func:`run_folder`, through the resolver ``kspipe_run_dir``.
A command given no run folder gets a new one named by the time, which it makes at once:
two commands started in the same second get two folders (:func:`new_folder`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import time
from dataclasses import dataclass

from kspipe.cluster import environment

RESOLVER = "kspipe_run_dir"

#: The resolver of ``hydra.searchpath`` in kspipe's config: the installed plugins' config
#: folders (``kspipe_config_dirs``), which the command sets before Hydra composes.
CONFIG_DIRS_RESOLVER = "kspipe_config_dirs"

#: Set in every pod of the ``PaddleJob`` manifest kspipe writes
#: (:mod:`kspipe.launchers.kubernetes`): a token drawn once per manifest, which tells a pod
#: that Kubernetes restarted from a pod of a new job given the same name.
JOB_TOKEN_ENV = "KSPIPE_JOB_TOKEN"


def job_id(given: str | None = None, env=os.environ, overrides: str = "") -> str:
    """The id of the job this process belongs to (see the module's text).  An allocation's
    id (``SLURM_JOB_ID``) may hold several commands: a digest of ``overrides`` (the
    command's) tells them apart, and stays the same for a requeued job."""
    if given:
        return str(given)
    if env.get("PADDLE_JOB_ID"):
        return env["PADDLE_JOB_ID"]
    if env.get("SLURM_JOB_ID"):
        return f"{env['SLURM_JOB_ID']}-{digest(overrides)}"
    endpoints = "|".join(
        ",".join(e.strip() for e in env.get(name, "").split(","))
        for name in ("PADDLE_PSERVERS_IP_PORT_LIST", "PADDLE_TRAINER_ENDPOINTS")
    )
    return digest(endpoints, 12)


def digest(text: str, length: int = 8) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:length]


def run_folder(
    run_dir: str | None = None,
    given_job_id: str | None = None,
    launcher: str | None = None,
    mode: str | None = None,
    overrides: str = "",
    env=os.environ,
    *,
    make: bool = True,
) -> str:
    """Where a command run with the Hydra config writes: ``run_dir`` if given; the job's
    folder for a role started by a scheduler, and for a ``cluster.launcher=slurm`` job in
    its allocation (a requeued job finds its checkpoints there); else a new folder named
    by the time, made here unless ``make`` is False (a command that only prints its
    config), which names it and makes nothing."""
    if run_dir:
        return os.path.expanduser(str(run_dir))
    if environment.given(mode, env) or (launcher == "slurm" and env.get("SLURM_JOB_ID")):
        name = re.sub(r"[^A-Za-z0-9._-]", "_", job_id(given_job_id, env, overrides))
        return os.path.join("outputs", f"job-{name}")
    name = os.path.join("outputs", time.strftime("%Y-%m-%d"), time.strftime("%H-%M-%S"))
    return new_folder(name) if make else name


_made: dict[str, str] = {}  # the folder new_folder made in this process, by its path


def new_folder(name: str) -> str:
    """``name``, or ``name-2``, ``name-3`` ...: the first that no other process has made,
    made here (a folder is made once: two commands started in the same second get one
    each); the same folder each time this process asks for ``name`` from one place."""
    key = os.path.abspath(name)
    n = 1
    while key not in _made:
        folder = name if n == 1 else f"{name}-{n}"
        try:
            os.mkdir(folder)
        except FileExistsError:
            n += 1
        except FileNotFoundError:  # its date folder: new, or removed meanwhile (remove_unused)
            os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
        else:
            _made[key] = folder
    return _made[key]


#: What Hydra writes into a run folder before the job begins (``hydra.output_subdir``).
HYDRA_FILES = {".hydra"}


def remove_unused(folder: str, own: bool = False) -> bool:
    """Remove the run folder ``folder`` if this process made it (:func:`new_folder`, or
    ``own``: a sweep's job's, which Hydra made for it) and nothing but Hydra's own files
    (:data:`HYDRA_FILES`) is in it, the job refused before it wrote anything; then the
    folders :func:`new_folder` made above it, if they are left empty.  Whether it was."""
    folder = os.path.abspath(folder)
    name = next((name for name, path in _made.items() if os.path.abspath(path) == folder), None)
    if not own and name is None:
        return False
    try:
        if set(os.listdir(folder)) - HYDRA_FILES:
            return False
        shutil.rmtree(folder)
    except OSError:
        return False
    if name is not None:  # outputs/<date>/, then outputs/, if nothing else is there
        del _made[name]
        above = os.path.dirname(name)
        for _ in range(2):
            try:
                os.rmdir(above)
            except OSError:
                break
            above = os.path.dirname(above)
    return True


def requeued_checkpoint(cfg, run_dir: str, env=os.environ) -> str | None:
    """The checkpoint to resume from when Slurm requeued this ``cluster.launcher=slurm``
    job (``SLURM_RESTART_COUNT``): the newest complete one in its run folder (a
    checkpoint is complete once its folder has its final name, which the first worker
    gives it after every other worker wrote its own part), else None.  Named outright, so
    that every process of the job loads that one.  The job's own checkpoint wins over a
    ``resume`` or ``init_from`` it was started with: those were its start, and it has gone
    on since."""
    from kspipe import checkpoint

    if cfg.cluster.get("launcher") != "slurm" or not int(env.get("SLURM_RESTART_COUNT") or 0):
        return None
    kept = checkpoint.checkpoints(os.path.join(run_dir, "checkpoints"))
    return max(kept) if kept else None


@dataclass(frozen=True)
class Attempt:
    """This run as one attempt of a job that a scheduler may start again: ``job``, the key
    every attempt of the job shares (and no other job), and ``restarts``, the attempts
    before this one where the scheduler counts them (Slurm), None where it does not (a
    ``PaddleJob``'s pod: the job's record in MLflow tells)."""

    job: str
    restarts: int | None


def attempt(cfg, env=os.environ) -> Attempt | None:
    """The job this run is an attempt of, if a scheduler may start it again in the same run
    folder: a ``cluster.launcher=slurm`` job in its allocation (``SLURM_JOB_ID``, requeued
    ``SLURM_RESTART_COUNT`` times), or a pod of the ``PaddleJob`` manifest kspipe wrote
    (its name and :data:`JOB_TOKEN_ENV`).  None for any other run: each is a job of its
    own, even in a run folder an earlier job used."""
    if cfg.cluster.get("launcher") == "slurm" and env.get("SLURM_JOB_ID"):
        return Attempt(f"slurm-{env['SLURM_JOB_ID']}", int(env.get("SLURM_RESTART_COUNT") or 0))
    if env.get(JOB_TOKEN_ENV) and environment.given(cfg.get("mode"), env):
        name = job_id(cfg.cluster.get("job_id"), env)
        return Attempt(f"paddlejob-{name}-{env[JOB_TOKEN_ENV]}", None)
    return None


_config_dirs: list[str] = []  # what ${kspipe_config_dirs:} gives: the command's plugins'


def register_resolver(make: bool = True, config_dirs: list[str] | None = None) -> None:
    """Make ``${kspipe_run_dir:<run_dir>,<cluster.job_id>,<cluster.launcher>,<mode>,
    <the command's overrides>}`` known to OmegaConf: :func:`run_folder`, which makes the
    new folder it names unless ``make`` is False.  Registering again replaces it: the
    ``kspipe`` command registers it last, saying whether its job may run.

    And ``${kspipe_config_dirs:}``, the search path (``hydra.searchpath``) of kspipe's
    config: ``config_dirs``, the folders installed plugins add, where the command gives
    them (it stays as it was where not).  In the config, not on Hydra's command line, so
    that Hydra reads its flags anywhere on the line and shows the user's overrides alone.
    """
    from omegaconf import OmegaConf

    resolver = run_folder if make else functools.partial(run_folder, make=False)
    # cached: one folder for a config, however often it is read
    OmegaConf.register_new_resolver(RESOLVER, resolver, use_cache=True, replace=True)
    if config_dirs is not None:
        _config_dirs[:] = config_dirs
    OmegaConf.register_new_resolver(CONFIG_DIRS_RESOLVER, lambda: list(_config_dirs), replace=True)
