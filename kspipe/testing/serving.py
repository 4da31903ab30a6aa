"""A run's MLflow model served in a test: an MLflow command serving HTTP in the
background, a request to it, and, for a Reptile run, a test task and the answer kspipe's
own adaptation gives it (what the served model must answer)."""

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
                [sys.executable, "-m", "mlflow", *args, "--host", "127.0.0.1", "--port",
                 str(port)], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)

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
    """``mlflow models serve`` of the run's model ``model`` in the MLflow store ``store``,
    started for the block (a :class:`Server`: call ``ready()``) and stopped after it."""
    server = Server(["models", "serve", "-m", f"runs:/{run_id}/model", "--env-manager",
                     "local"], "/ping", cwd, dict(os.environ, MLFLOW_TRACKING_URI=store))
    try:
        yield server
    finally:
        server.stop()


def invoke(url: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` (JSON) to the model server at ``url``: its status and JSON answer,
    an error's too."""
    request = urllib.request.Request(url + "/invocations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def a_test_task(run_dir: Path):
    """A test task of a Reptile run's data set (two queries per class), the data set and
    the run's config (as its inference model holds it)."""
    import numpy as np
    from omegaconf import OmegaConf

    from kspipe.fewshot import plugin as open_ks
    from kspipe.fewshot.data import sample_task
    from kspipe.modes.role import Role

    cfg = OmegaConf.load(run_dir / "inference_model" / "kspipe_config.yaml")
    dataset = open_ks.kspipe_read_dataset(cfg=cfg, role=Role())
    task = sample_task(dataset.test, cfg.task.ways, cfg.task.shots, 2, np.random.default_rng(7))
    return task, dataset, cfg


def reference_adaptation(run_dir: Path, task, dataset, seed: int):
    """kspipe's own adaptation of ``task`` from a Reptile run's final model, as its
    evaluation of the run (``evaluate=<run>``) does it: the logits of the queries."""
    import numpy as np
    import paddle
    from omegaconf import OmegaConf

    from kspipe.modes.role import Role
    from kspipe.reptile import plugin as reptile
    from kspipe.reptile.learner import ReptileLearner
    from kspipe.reptile.tasks import nchw

    paddle.enable_static()
    cfg = OmegaConf.load(run_dir / "inference_model" / "kspipe_config.yaml")
    programs = reptile.kspipe_build_program(cfg=cfg, dataset=dataset, role=Role())
    programs = reptile.kspipe_compile_program(cfg=cfg, role=Role(), programs=programs)
    learner = ReptileLearner(cfg, dataset, programs, paddle.static.Executor(paddle.CPUPlace()),
                             paddle.static.Scope(), None)
    learner.initialize()
    learner.load_checkpoint(str(run_dir), "evaluate")
    learner.adapt(nchw(task.support_x), task.support_y, cfg.eval.inner_batch,
                  cfg.eval.inner_iters, np.random.default_rng(seed))
    return learner.query_logits(nchw(task.support_x), nchw(task.query_x))
