"""The MLflow store: where it is, the lock it is opened under, a client on it, its runs page.

The store is ``cfg.tracking.uri``, by default a SQLite file ``mlflow.db`` in the folder
kspipe was started in.  Every client comes from :func:`client_for`, which opens the store
once under a lock (:func:`store_lock`): MLflow creates or migrates a SQLite store on its
first call, and jobs started together would otherwise race to do it.  A store that cannot
be opened is a one-line :class:`~kspipe.errors.ConfigError` before anything runs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os

from kspipe.errors import ConfigError, KspipeError, first_line, storage_error
from kspipe.files import user_path

# MLflow 3 reports its use to MLflow's servers from a thread and writes an id of its own in
# ~/.config/mlflow, both from its import on: a training job does neither unasked (a user
# who wants it sets MLFLOW_DISABLE_TELEMETRY=false).  kspipe's modules that import MLflow
# import this one first (tracking and sweep_runs; serving is imported after them).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def tracking_uri(cfg) -> str:
    uri = cfg.tracking.uri or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not os.path.isabs(uri[len("sqlite:///") :]):
        uri = "sqlite:///" + user_path(uri[len("sqlite:///") :])  # from where kspipe started
    return uri


def client_for(cfg):
    """An ``MlflowClient`` on ``cfg``'s store, with MLflow's own logging quietened.

    The client is made, and the experiment ``cfg.tracking.experiment`` found or created,
    while holding :func:`store_lock`: the first of several jobs started at once creates (or
    migrates) the store and the experiment, the others wait for it and then find them.
    A store that cannot be opened raises :class:`ConfigError` naming ``tracking.uri``.
    """
    import logging

    from mlflow import MlflowClient

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # it logs a database error with its SQL before raising it: kspipe says it in one line
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    uri = tracking_uri(cfg)
    probe_server(uri)
    with store_lock(uri):
        begun = begins_store(uri)
        try:
            probe_sqlite(uri)
            client = MlflowClient(tracking_uri=uri)
            experiment_id(client, cfg.tracking.experiment, uri)
        except BaseException as err:
            if begun:  # a store half made (a full disk) is no store: the next one begins anew
                remove_store(begun)
            if isinstance(err, KspipeError) or not isinstance(err, Exception):
                raise
            # MLflow's, SQLAlchemy's, the file system's: all say why
            raise store_error(uri, err) from err
    return client


def experiment_id(client, name: str, uri: str | None = None) -> str:
    """The id of the experiment ``name``, created if there is none (in the store ``uri``,
    if given: :func:`create_experiment`)."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return create_experiment(client, name, uri)
    except MlflowException:  # made meanwhile by a process that does not take the lock
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def create_experiment(client, name: str, uri: str | None) -> str:
    """A new experiment ``name``.  In a SQLite store its runs' artifacts go beside the store,
    in ``mlruns/<experiment id>`` (MLflow would put them in ``./mlruns`` of whichever folder
    the job that made the experiment ran in, wherever the store is)."""
    path = sqlite_path(uri) if uri else None
    if path is None:
        return client.create_experiment(name)
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    beside = os.path.join(os.path.dirname(os.path.abspath(path)), "mlruns")
    return SqlAlchemyStore(uri, beside).create_experiment(name)


def runs_page(cfg, experiment: str, headline: str = "") -> str:
    """The command that serves the store (none for a tracking server: it serves its own
    UI), and the page of the experiment's runs table
    (``mlflow ui`` opens an experiment on its overview, not on its runs), best
    ``headline`` first: sorted by a metric, the table also lists a sweep's child runs
    instead of folding them under their parent."""
    order = f"?orderByKey=metrics.%60{headline}%60&orderByAsc=false" if headline else ""
    uri = tracking_uri(cfg)
    page = f"#/experiments/{experiment}/runs{order}"
    if is_server(uri):  # a tracking server serves its own UI (the browser asks the login)
        return f"runs: {without_login(uri).rstrip('/')}/{page}"
    return f"runs: mlflow ui --backend-store-uri {uri} then http://127.0.0.1:5000/{page}"


# --- the lock a SQLite store is opened under ------------------------------------------


def sqlite_path(uri: str) -> str | None:
    """The database file of a ``sqlite:///`` URI; None for another store or an in-memory one."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].partition("?")[0]
    return path if path and path != ":memory:" else None


@contextlib.contextmanager
def store_lock(uri: str):
    """Hold an exclusive lock on a SQLite store while it is opened; nothing for other stores.

    The lock is ``flock`` on the store's folder itself (made if missing), so it leaves no
    file behind; it goes with the descriptor, when the block ends or the process dies.
    """
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    try:
        fd = lock_folder(path)
    except OSError as err:
        raise store_error(uri, err) from err
    try:
        yield
    finally:
        os.close(fd)


def begins_store(uri: str) -> str | None:
    """The file of the SQLite store ``uri`` if opening it now creates it (missing, or left
    empty by :func:`lock_folder` or :func:`remove_store`); else None (a symbolic link is
    never taken for a new store).  Asked under :func:`store_lock`."""
    path = sqlite_path(uri)
    if path is None or os.path.islink(path) or (os.path.exists(path) and os.path.getsize(path)):
        return None
    return path


def remove_store(path: str) -> None:
    """Undo a SQLite store half made: its file emptied (not removed: where the lock is on
    the file itself, a job waiting for it must find the same file, and an empty one is a
    new store to the next job) and its journals removed, as far as the disk allows."""
    with contextlib.suppress(OSError):
        os.truncate(path, 0)
    for journal in (path + "-journal", path + "-wal", path + "-shm"):
        with contextlib.suppress(OSError):
            os.remove(journal)


def lock_folder(path: str) -> int:
    """An open descriptor holding ``flock`` on ``path``'s folder.  Where the file system
    does not lock folders, the file ``path`` is locked instead (created empty if missing,
    which SQLite reads as a new database)."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    try:
        return flocked(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as err:
        if err.errno not in FOLDER_LOCK_REFUSED:
            raise
    return flocked(path, os.O_RDWR | os.O_CREAT)


def flocked(path: str, flags: int) -> int:
    """``path`` opened with ``flags`` and locked exclusively (waiting for the lock)."""
    fd = os.open(path, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: What ``flock`` on a folder answers on a file system that only locks files.
FOLDER_LOCK_REFUSED = (errno.EBADF, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP)


def probe_sqlite(uri: str) -> None:
    """Read a SQLite store's header, so a file that is no database (or cannot be read) fails
    at once; MLflow would retry it for about two minutes."""
    path = sqlite_path(uri)
    if path is None:
        return
    import sqlite3

    connection = sqlite3.connect(path)
    try:
        connection.execute("pragma schema_version").fetchone()
    finally:
        connection.close()


#: Seconds between the tries to reach a tracking server: one restarting gets a moment,
#: one that is not there fails in seconds (MLflow's own retries take about four minutes).
SERVER_WAITS = (1, 2, 4)


def probe_server(uri: str, waits: tuple = SERVER_WAITS) -> None:
    """Reach a tracking server's ``/health`` (an ``http`` or ``https`` store), trying again
    after each of ``waits`` (seconds); if it does not answer, raise :class:`ConfigError` at
    once.  An answer is any HTTP status below 500 (a proxy's 502-504 for a server behind
    it that is down is none) or a certificate this machine does not trust (MLflow then
    says what is wrong)."""
    if not is_server(uri):
        return
    import ssl
    import time
    import urllib.error
    import urllib.request

    health = without_login(uri).rstrip("/") + "/health"  # asks no login
    for wait in (*waits, None):
        try:
            urllib.request.urlopen(health, timeout=5).close()
            return
        except urllib.error.HTTPError as err:
            if err.code < 500:
                return
            reason = f"HTTP {err.code}"
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            if isinstance(reason, ssl.SSLCertVerificationError):
                return
            reason = first_line(reason)
        if wait is None:
            raise ConfigError(
                f"tracking.uri={shown(uri)}: cannot open the MLflow store: no "
                f"server answers there ({reason}); start it, or run with "
                f"tracking.enabled=false"
            )
        time.sleep(wait)


def is_server(uri: str) -> bool:
    """Whether the store at ``uri`` is a tracking server (HTTP)."""
    return uri.startswith(("http://", "https://"))


def without_login(uri: str) -> str:
    """``uri`` with no ``user:password@`` in it."""
    import urllib.parse

    parts = urllib.parse.urlsplit(uri)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def shown(uri: str) -> str:
    """``uri`` as kspipe prints it: a password in it masked."""
    import urllib.parse

    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    login, _, host = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{login.partition(':')[0]}:***@{host}").geturl()


def store_error(uri: str, err: Exception) -> ConfigError:
    """The one line for a store that cannot be opened, with the reason's first line."""
    return ConfigError(
        f"tracking.uri={shown(uri)}: cannot open the MLflow store: {first_line(driver_error(err))}"
    )


def driver_error(err: BaseException) -> BaseException:
    """The database driver's own error under MLflow's and SQLAlchemy's wrappings (whose
    first line can be SQLAlchemy's "raised as a result of Query-invoked autoflush"): a
    full disk's "database or disk is full"; else ``err``."""
    seen = err
    while seen is not None:
        orig = getattr(seen, "orig", None)  # SQLAlchemy's DBAPIError: the driver's error
        if isinstance(orig, BaseException):
            return orig
        seen = seen.__cause__
    return err


#: SQLite's answers when its file cannot be written: the disk, not the store, is at fault.
SQLITE_REFUSALS = ("SQLITE_FULL", "SQLITE_READONLY", "SQLITE_IOERR")


def write_refused(err: BaseException) -> str | None:
    """Why a store on this machine's disks could not write, if the disk refused it (full,
    read-only, failing: SQLite's own error, or an artifact's ``OSError``); else None.
    kspipe's own errors (a store that cannot be opened) already say it."""
    if isinstance(err, KspipeError):
        return None
    driver = driver_error(err)
    if str(getattr(driver, "sqlite_errorname", "")).startswith(SQLITE_REFUSALS):
        return first_line(driver)
    seen, looked = err, set()
    while seen is not None and id(seen) not in looked:  # causes can loop
        looked.add(id(seen))
        refused = storage_error(seen, "an artifact")
        if refused is not None:
            return str(refused)
        seen = seen.__cause__ or seen.__context__
    return None
