"""Disks that refuse writes, for the tests of a job whose disk fills or is read-only:
real mounts (a small tmpfs, a read-only bind mount), so root only."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path


@functools.cache
def mounts_missing() -> str | None:
    """Why no disk can be mounted here (not root, no ``mount``, a container that allows
    none: a small tmpfs is tried), or None."""
    if os.geteuid() != 0:
        return "mounting a disk needs root"
    if shutil.which("mount") is None:
        return "no mount command"
    with tempfile.TemporaryDirectory() as folder:
        try:
            with small_disk(Path(folder), 64 * 1024):
                pass
        except subprocess.CalledProcessError as err:
            return f"no disk can be mounted here: {(err.stderr or '').strip()[:200]}"
    return None


@contextmanager
def small_disk(folder: Path, size: int):
    """``folder`` (made) is a tmpfs of ``size`` bytes while the block runs."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        check=True,
        capture_output=True,
        text=True,
    )
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(path: Path) -> None:
    """Write the file ``path`` until its disk refuses more (a disk made full)."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(bytes(1 << 16))
                f.flush()
        except OSError:
            pass


def resize(folder: Path, size: int) -> None:
    """Make the tmpfs of :func:`small_disk` at ``folder`` ``size`` bytes, its files kept."""
    subprocess.run(
        ["mount", "-o", f"remount,size={size}", str(folder)],
        check=True,
        capture_output=True,
        text=True,
    )


@contextmanager
def read_only(folder: Path):
    """``folder`` (made) is read-only while the block runs (a read-only bind mount of
    itself): a write into it fails with EROFS."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


PAGE = 4096


def disk_size(folder: Path) -> int:
    """The bytes ``folder``'s files would take on a tmpfs: each file's bytes in whole
    pages (what a file system of its own, compressing or inlining, says is no guide)."""
    return sum(-(-f.stat().st_size // PAGE) * PAGE for f in Path(folder).rglob("*") if f.is_file())
