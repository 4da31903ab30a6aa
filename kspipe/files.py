"""Where kspipe keeps files between runs, and how it builds them without half-written
results: one cache-folder rule and one atomic build for every generated data set."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

CACHE_ENV = "KSPIPE_CACHE_DIR"
#: The folder the user started kspipe in; a cluster's processes run in the run folder.
WORKDIR_ENV = "KSPIPE_WORKDIR"


def user_path(path) -> str:
    """A path from the config or command line, as the user meant it: ``~`` expanded and a
    relative path taken from the folder kspipe was started in (``$KSPIPE_WORKDIR``, which
    a launcher sets for its processes, else the current folder)."""
    path = os.path.expanduser(str(path))
    if os.path.isabs(path):
        return path
    return os.path.join(os.environ.get(WORKDIR_ENV) or os.getcwd(), path)


def workdir() -> str:
    """The folder the user started kspipe in (for a launcher to hand to its processes)."""
    return os.environ.get(WORKDIR_ENV) or os.getcwd()


def cache_dir(override: str | None = None) -> Path:
    """The cache folder: ``override``, else ``$KSPIPE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/kspipe``, else ``~/.cache/kspipe``."""
    if override:
        return Path(user_path(override))
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "kspipe"


def atomic_build(final: Path | str, build, done_marker: str) -> Path:
    """Build a folder at ``final`` with ``build(tmp_folder)``, all or nothing.

    The build writes into a temporary folder beside ``final`` that is renamed into place
    at the end, so a process that dies leaves no half-built folder, and two processes
    building the same folder at once both end with one complete copy.  ``final`` counts
    as built once ``final/done_marker`` exists.
    """
    final = Path(final)
    if (final / done_marker).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{final.name}-building-", dir=final.parent))
    try:
        build(building)
        try:
            os.rename(building, final)
        except OSError:  # another process finished the same build first
            if not (final / done_marker).exists():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return final


def files_digest(paths) -> str:
    """The digest of the files ``paths`` (8 hex digits of a SHA-256, as MLflow's own data
    sets have): their contents and their names relative to the folder they share, in
    order of name, so the same files give the same digest wherever they are."""
    import hashlib

    paths = sorted({os.path.abspath(p) for p in paths})
    if not paths:
        return hashlib.sha256(b"").hexdigest()[:8]
    common = os.path.commonpath([os.path.dirname(p) for p in paths])
    digest = hashlib.sha256()
    for path in paths:
        digest.update(os.path.relpath(path, common).encode() + b"\0")
        content = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                content.update(block)
        digest.update(content.digest())
    return digest.hexdigest()[:8]
