"""A checkpoint resumed on another number of workers or servers: the size that wrote it.

``resume=`` takes a checkpoint to a job of any size.  The workers' state is the model,
whole in every worker, and each worker's own part (a Reptile worker's optimiser state):
a workload splits its work anew among the new workers.  The parameter servers' tables are
split anew for the new servers when they load (:func:`kspipe.checkpoint.tables.reshard`).
This module reads the size that wrote a checkpoint from the config saved beside it, for
the one line that says the job resumes at another size, and for a workload's own rule of
what sizes it can resume at (Reptile's whole rounds).
"""

from __future__ import annotations

import os

from kspipe import checkpoint
from kspipe.cluster.endpoints import process_count
from kspipe.files import user_path

#: The modes whose processes include parameter servers.
WITH_SERVERS = ("pserver",)


def size(cfg) -> tuple[int, int]:
    """(workers, servers) of the job ``cfg`` describes (one worker, no servers, locally)."""
    mode = cfg.get("mode", "local")
    if mode == "local":
        return 1, 0
    workers = process_count(cfg.workers, "workers")
    return workers, process_count(cfg.servers, "servers") if mode in WITH_SERVERS else 0


def saved_size(found: str) -> tuple[int, int] | None:
    """(workers, servers) of the job that wrote the checkpoint ``found``, from the config
    saved in it; None where it has none that says (a checkpoint written by hand)."""
    from omegaconf import OmegaConf

    file = os.path.join(found, "config.yaml")
    try:
        return size(OmegaConf.load(file))
    except Exception:  # none, or unreadable: the size is not known, nothing is refused for it
        return None


def resumed(cfg) -> tuple[str, tuple[int, int]] | None:
    """(the checkpoint, the size that wrote it) that ``cfg.resume`` names; None without
    ``resume`` or a saved config."""
    if not cfg.get("resume"):
        return None
    found = checkpoint.latest(user_path(cfg.resume))
    saved = saved_size(found)
    return (found, saved) if saved is not None else None


def resize_line(cfg) -> str | None:
    """The one line that says a job resumes a checkpoint at another size, e.g. ``resumes
    checkpoint-0000040 of 2 workers and 1 server on 3 workers and 2 servers; tables
    re-sharded``; None if it resumes at the size that wrote it, or resumes nothing."""
    found = resumed(cfg)
    if found is None:
        return None
    path, before = found
    after = size(cfg)
    if before == after:
        return None
    line = f"resumes {os.path.basename(path)} of {said(*before)} on {said(*after)}"
    tables = os.path.isdir(os.path.join(path, checkpoint.TABLES))
    if tables and before[1] != after[1]:
        line += "; tables re-sharded"
    return line


def said(workers: int, servers: int) -> str:
    """``2 workers and 1 server``, ``1 worker``."""
    text = f"{workers} worker{'s' * (workers != 1)}"
    if servers:
        text += f" and {servers} server{'s' * (servers != 1)}"
    return text
