"""The errors kspipe reports to a user as one line, the one printer of that line (and of
the first line of a library's exception), and the one place numbers from a config are
checked to be whole and large enough."""

from __future__ import annotations

import errno
import sys


class KspipeError(Exception):
    """A problem the user can fix: bad configuration, bad data, a failed cluster.

    The command line prints ``kspipe: error: <message>`` and exits non-zero.
    """

    exit_code = 2


class ConfigError(KspipeError):
    """A configuration value is missing, out of range or names nothing known."""


class DataError(KspipeError):
    """A data folder or file is missing, empty, unreadable or too small for the task."""


class ClusterError(KspipeError):
    """A process of a distributed job failed, or the cluster could not be started."""

    exit_code = 3


class Stalled(ClusterError):
    """A process of a distributed job made no progress for ``cluster.stall_seconds``
    (stopped, deadlocked, or waiting on one that is): its launcher stopped the job
    (kspipe/launchers/stalls.py)."""


class StorageError(KspipeError):
    """A disk refused a write: full, over its quota, read-only or failing."""


class NonFiniteError(KspipeError):
    """Training went non-finite: a loss or metric a stage reported (a number, or any element
    of an array or tensor) is NaN or infinite, or a parameter of the model is, at a
    checkpoint or when training ends (:mod:`kspipe.reporting`)."""


#: The errors of a disk that refuses a write: where the job writes is at fault, not the job.
STORAGE_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO))


def storage_error(err: BaseException, where: str) -> StorageError | None:
    """``err`` as one line, if it is a disk refusing a write (:data:`STORAGE_ERRNOS`);
    ``where`` says what was being written when the error names no file."""
    if not isinstance(err, OSError) or err.errno not in STORAGE_ERRNOS:
        return None
    reason = err.strerror or first_line(err)
    return StorageError(f"{reason}: {err.filename}" if err.filename else f"{reason} ({where})")


def first_line(err: Exception) -> str:
    """The first non-blank line of ``err``'s message (its type's name if it has none): what
    a one-line error quotes of a library's exception."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def print_error(message, prog: str = "kspipe") -> None:
    """``<prog>: error: <message>`` on standard error: how every kspipe command fails."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


def check_integer(value, key: str, minimum: int = 1) -> int:
    """``value`` if it is an integer of at least ``minimum``; else a ConfigError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r} must be an integer")
    if value < minimum:
        raise ConfigError(f"{key}={value} must be at least {minimum}")
    return value


def check_number(value, key: str, minimum: float = 0, above: bool = False) -> float:
    """``value`` if it is a number of at least (``above``: more than) ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r} must be a number")
    if value < minimum or (above and value == minimum):
        raise ConfigError(f"{key}={value} must be {'more than' if above else 'at least'} {minimum}")
    return value


def check_keys(cfg, minimums: dict, numbers: tuple = ()) -> None:
    """Each ``key: minimum`` of ``minimums`` an integer of at least that; ``numbers`` at least 0."""
    for key, minimum in minimums.items():
        check_integer(lookup(cfg, key), key, minimum)
    for key in numbers:
        check_number(lookup(cfg, key), key, 0)


def lookup(cfg, key: str):
    """The value at the dotted ``key`` of ``cfg``, or None where a part of it is missing."""
    value = cfg
    for part in key.split("."):
        value = value.get(part) if hasattr(value, "get") else None
    return value
