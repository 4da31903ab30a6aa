"""What some tests need from the machine (a Slurm, Chromium, disks it can mount, network
namespaces for an emulated cluster), why each
is missing, and which must work here.

On Debian (apt) as root, ``.ci/run`` installs Slurm and Chromium, and a disk needs only root
to be mounted: there, under ``CI=true``, a test skipped for want of one of them is a failure
(tests/conftest.py), so that CI cannot pass by skipping them."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

from tests.kit.disks import mounts_missing
from tests.kit.network import unavailable as network_missing
from tests.kit.slurm import slurm_missing

#: Why the browser test is skipped where there is no Chromium (tests/cli/test_search.py).
CHROMIUM_MISSING = "no chromium binary (apt-get install -y chromium)"


def chromium_missing() -> str | None:
    """Why no headless Chromium can be started here, or None."""
    if shutil.which("chromium") or shutil.which("chromium-browser"):
        return None
    return CHROMIUM_MISSING


def must_work_here() -> bool:
    """Whether this machine is one where Slurm, Chromium and mounted disks must work: root,
    on Debian with apt (the README's set-up, which ``.ci/run`` installs)."""
    return (
        os.geteuid() == 0
        and shutil.which("apt-get") is not None
        and Path("/etc/debian_version").exists()
    )


@functools.cache
def missing_here() -> dict[str, str]:
    """The set-ups that must work on this machine and do not: each one's name, and why it
    is missing (the reason its tests are skipped with)."""
    if not must_work_here():
        return {}
    why = {
        "Slurm": slurm_missing(),
        "Chromium": chromium_missing(),
        "a mountable disk": mounts_missing(),
        "an emulated network": network_missing(),
    }
    return {name: reason for name, reason in why.items() if reason}
