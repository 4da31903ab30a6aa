"""The job's secret: what lets kspipe's own sockets tell the job's processes from anyone else.

kspipe opens four kinds of socket for a job: the gloo meeting point (an HTTP store,
:mod:`kspipe.cluster.addresses`), the first host's control endpoint of a job across hosts
(:mod:`kspipe.launchers.hosts`), each worker's listener of the sum's chain
(:mod:`kspipe.modes.summing`) and each shard summer's (:mod:`kspipe.modes.ps.summer`).
Each takes a peer only once it has shown that it knows the job's secret, by answering a
challenge (:mod:`kspipe.cluster.greetings`): the listener sends a fresh random
:func:`nonce`, the peer answers with an HMAC of the secret over the socket's purpose, its
name and that nonce (:func:`answer`), compared in constant time (:func:`matches`), and the
listener proves the same to the peer over the peer's own nonce; a greeting recorded on one
connection answers no other.  Gloo's own HTTP client cannot answer one, so its keys live
under a path made from the secret (:func:`token`), and the book refuses any other path.

The ``kspipe`` command that starts a job makes the secret (:func:`ensure`) and hands it
to every process the way Paddle's contract reaches them, in the environment
(:data:`SECRET_ENV`): kspipe's launcher, Slurm's steps and Paddle's launcher pass it on.
A job whose launchers run one per host cannot draw one secret alone: the user gives the
same one on every host (``KSPIPE_JOB_SECRET``, or ``cluster.secret_file``), else the job
is refused before anything starts.  A ``PaddleJob``'s pods read it from a Kubernetes
Secret (:mod:`kspipe.launchers.kubernetes`).  The secret is never written to the run's
params, artifacts or logs: only the name of the file that holds it is in the config.

What it does not do: the traffic is not encrypted, so a peer that can read the network
can learn the gloo token and the greetings; keep the job on a trusted network (Paddle's
own ports have no authentication at all: docs/distributed.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import sys
import threading

from kspipe.errors import ConfigError

#: Where a job's processes find the secret (hex, at least :data:`SHORTEST` characters).
SECRET_ENV = "KSPIPE_JOB_SECRET"
SHORTEST = 32
#: The length of a greeting's tag (an HMAC-SHA256).
TAG_BYTES = 32
#: The length of a challenge's nonce.
NONCE_BYTES = 16


#: The secret this process drew itself, if it did (a sweep's next job draws another).
_drawn: str | None = None


def ensure(secret_file: str | None = None, across_hosts: bool = False, new_job=False) -> str:
    """The job's secret, put in this process's environment for every process it starts:
    the environment's, else ``secret_file``'s, else a new one (refused for a job across
    hosts, whose launchers must share one).  ``new_job``: a job begins, and a secret this
    process drew for an earlier one is not reused."""
    global _drawn
    given, where = os.environ.get(SECRET_ENV), SECRET_ENV
    if new_job and given and given == _drawn:
        given = None
    if not given and secret_file:
        given, where = read_file(secret_file), f"cluster.secret_file={secret_file}"
    if not given:
        if across_hosts:
            raise ConfigError(
                f"a job across hosts needs the same secret on every host: export "
                f"{SECRET_ENV} (e.g. python -c 'import secrets; print(secrets.token_hex(32))') "
                f"or set cluster.secret_file on each"
            )
        given = _drawn = secrets.token_hex(32)
    check(given, where)
    os.environ[SECRET_ENV] = given
    return given


def read_file(path: str) -> str:
    try:
        with open(os.path.expanduser(path)) as f:
            return f.read().strip()
    except OSError as err:
        raise ConfigError(f"cluster.secret_file={path}: {err.strerror}") from None


def check(secret: str, where: str) -> None:
    if len(secret) < SHORTEST or any(c.isspace() for c in secret):
        raise ConfigError(
            f"{where}: the job's secret is {SHORTEST} characters or more, without spaces "
            f"(python -c 'import secrets; print(secrets.token_hex(32))' makes one)"
        )


def current(env=os.environ) -> bytes:
    """The secret a process of the job was given (a ConfigError naming the variable if
    none was: every process of a job needs it to meet the others)."""
    secret = env.get(SECRET_ENV, "")
    if not secret:
        raise ConfigError(
            f"{SECRET_ENV} is not set: the job's processes need the secret the kspipe "
            f"command hands them (a PaddleJob's pods: from its Kubernetes Secret)"
        )
    return secret.encode()


def tag(purpose: str, name: str, env=os.environ) -> bytes:
    """What a peer that knows the secret sends to be taken as ``name`` (a worker's index, a
    host) by the socket of ``purpose``: an HMAC, so the secret itself never travels."""
    message = f"{purpose}\0{name}".encode()
    return hmac.new(current(env), message, hashlib.sha256).digest()


def nonce() -> bytes:
    """A fresh random challenge (:data:`NONCE_BYTES`): a greeting answers this one alone."""
    return secrets.token_bytes(NONCE_BYTES)


def answer(purpose: str, side: str, name: str, challenge: bytes, env=os.environ) -> bytes:
    """What the ``side`` ("connector" or "listener") of a connection to the socket of
    ``purpose`` sends to prove it knows the secret, as ``name``, in reply to ``challenge``
    (the other side's nonce): an HMAC over all four, so a reply fits one challenge, one
    side and one name."""
    message = f"{purpose}\0{side}\0{name}\0".encode() + challenge
    return hmac.new(current(env), message, hashlib.sha256).digest()


def matches(got: bytes, expected: bytes) -> bool:
    """Whether a received tag is the expected one (compared in constant time)."""
    return hmac.compare_digest(got, expected)


def token(purpose: str, env=os.environ) -> str:
    """A path component made from the secret (for the gloo store's keys): 32 hex digits."""
    return tag(purpose, "", env)[:16].hex()


#: How many refused connections a process logs (a flood of strangers must not fill it).
LOGGED_REFUSALS = 20
_refusals = 0
_lock = threading.Lock()


def refused(what: str, peer, why: str) -> None:
    """Say, in one line of this process's log, that a connection to ``what`` from ``peer``
    (an address tuple, or None) was closed and why; the job goes on.  One write per line:
    refusals said by several threads at once stay lines of their own."""
    global _refusals
    with _lock:
        _refusals += 1
        count = _refusals
    if count > LOGGED_REFUSALS:
        return
    where = f" from {peer[0]}:{peer[1]}" if peer else ""
    more = "; further refusals are not logged" if count == LOGGED_REFUSALS else ""
    sys.stderr.write(f"kspipe: refused a connection to {what}{where}: {why}{more}\n")
    sys.stderr.flush()
