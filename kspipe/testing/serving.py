"""A run's MLflow model served in a test: an MLflow command serving HTTP in the
background, and a request to it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


class Server:
    """An MLflow command (``mlflow <args>``, e.g. ``["server", ...]``) serving HTTP on a
    free port of 127.0.0.1, started in the background with its output in a log file of
    ``cwd``: ``ready()`` waits until it answers ``health``, ``stop()`` ends it."""

    def __init__(self, args: list[str], health: str, cwd: Path, env: dict | None = None):
        from kspipe.cluster.endpoints import free_ports

        (port,) = free_ports(1)
        self.url, self.health = f"http://127.0.0.1:{port}", health
        self.log = cwd / f"server-{port}.log"
        temporary = cwd / f"server-{port}-tmp"  # MLflow's lock files, kept out of /tmp
        temporary.mkdir()
        env = dict(env or os.environ, TMPDIR=str(temporary))
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mlflow", *args, "--host", "127.0.0.1", "--port", str(port)],
                cwd=cwd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def ready(self, timeout: float = 180) -> str:
        """The server's URL, once it answers."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                urllib.request.urlopen(self.url + self.health, timeout=5).close()
                return self.url
            except OSError:
                assert time.monotonic() < deadline, f"{self.log}: the server did not start"
                time.sleep(0.5)

    def stop(self) -> None:
        """End the server and every process it started (SIGTERM, then SIGKILL)."""
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


@contextlib.contextmanager
def model_server(store: str, run_id: str, cwd: Path):
    """``mlflow models serve`` of the run's model ``model`` in the MLflow store ``store``
    (``run_id``: a run's id, or a model's URI such as ``models:/<name>@<alias>``), started
    for the block (a :class:`Server`: call ``ready()``) and stopped after it."""
    model = run_id if ":/" in run_id else f"runs:/{run_id}/model"
    server = Server(
        ["models", "serve", "-m", model, "--env-manager", "local"],
        "/ping",
        cwd,
        dict(os.environ, MLFLOW_TRACKING_URI=store),
    )
    try:
        yield server
    finally:
        server.stop()


def invoke(url: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` (JSON) to the model server at ``url``: its status and JSON answer,
    an error's too."""
    request = urllib.request.Request(
        url + "/invocations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
