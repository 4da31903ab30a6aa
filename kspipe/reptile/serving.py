"""Few-shot inference as a service: adapt the meta-learned initialisation on the request's
support set, then classify its queries.

A request is one task: a table with a row per image, the column ``image`` (the image's
values, H x W x C flattened, in 0..1 as the data set gives them) and the column ``label``
(the class 0..ways-1 of a support image, -1 for a query).  :class:`FewShotModel` adapts
exactly as the run's evaluation adapts a test task (:meth:`Adapter.adapt
<kspipe.reptile.adaptation.Adapter.adapt>`, from the trained weights and inner optimiser
state, ``eval.inner_iters`` steps of ``eval.inner_batch`` images), classifies the queries as
it does (:meth:`Adapter.query_logits <kspipe.reptile.adaptation.Adapter.query_logits>`), and
answers one row per query: ``class`` and the ``probabilities`` of the ways.  The inner
batches are shuffled by the parameter ``seed`` (default: the run's ``seed``); the model's
own state is restored after every request.
"""

from __future__ import annotations

import os

import numpy as np

from kspipe.errors import DataError
from kspipe.inference import MODEL_NAME
from kspipe.process.memory import threaded_executor

QUERY = -1  # the label of a query image


class FewShotModel:
    """A trained Reptile model, rebuilt from its config and state, adapting per request.

    :param artifacts: ``inference_model`` (the exported model and the config beside it)
        and, where the run kept one, ``checkpoint`` (the whole training state, inner
        optimiser included: adaptation then starts where the run's evaluation starts).
    """

    def __init__(self, artifacts: dict):
        import paddle
        from omegaconf import OmegaConf

        from kspipe.compiling import compile_options
        from kspipe.reptile.adaptation import Adapter
        from kspipe.reptile.programs import build_programs

        paddle.enable_static()
        threaded_executor()  # requests arrive on the server's threads (kspipe.reptile.lanes)
        model_dir = artifacts["inference_model"]
        cfg = OmegaConf.load(os.path.join(model_dir, "kspipe_config.yaml"))
        self.cfg = cfg
        self.image_shape = exported_image_shape(model_dir)
        programs = build_programs(
            self.image_shape,
            cfg.task.ways,
            cfg.model,
            cfg.train.inner_lr,
            cfg.seed,
            cfg.train.inner_optimizer,
            cfg.train.weight_decay,
        )
        programs.compiled_train = compile_options(cfg, programs.train, programs.forward)
        executor = paddle.static.Executor(paddle.CPUPlace())
        self.model = Adapter(cfg, programs, executor, paddle.static.Scope())
        self.model.initialize()
        if artifacts.get("checkpoint"):
            self.model.load_state(artifacts["checkpoint"], "checkpoint")
        else:  # the weights alone; the inner optimiser starts fresh
            load_weights(self.model, model_dir)
        self.model.run(programs.snapshot)

    @staticmethod
    def artifacts(run_dir: str) -> dict:
        """What the MLflow model carries of the run folder ``run_dir``: the inference model
        and the checkpoint it was exported from, the run's newest (an ``evaluate=`` run's:
        the one it evaluated), if there is one."""
        from omegaconf import OmegaConf

        from kspipe import checkpoint
        from kspipe.files import user_path

        found = {"inference_model": os.path.join(run_dir, "inference_model")}
        kept = checkpoint.checkpoints(os.path.join(run_dir, "checkpoints"))
        evaluated = OmegaConf.load(
            os.path.join(found["inference_model"], "kspipe_config.yaml")
        ).get("evaluate")
        if kept:
            found["checkpoint"] = max(kept)
        elif evaluated:
            found["checkpoint"] = checkpoint.latest(user_path(evaluated), "evaluate")
        return found

    @staticmethod
    def example(artifacts: dict) -> dict:
        """A task of blank images (one support image per class and one query), the shape
        of its answer, and the request's parameter ``seed`` (default: the run's)."""
        import pandas as pd
        from omegaconf import OmegaConf

        model_dir = artifacts["inference_model"]
        cfg = OmegaConf.load(os.path.join(model_dir, "kspipe_config.yaml"))
        size = int(np.prod(exported_image_shape(model_dir)))
        labels = [*range(cfg.task.ways), QUERY]
        return {
            "input": pd.DataFrame({"image": [[0.5] * size for _ in labels], "label": labels}),
            "output": pd.DataFrame(
                {"class": [0], "probabilities": [[1.0 / cfg.task.ways] * cfg.task.ways]}
            ),
            "params": {"seed": int(cfg.seed)},
        }

    def predict(self, frame, params: dict):
        """The class and the ways' probabilities of each query row of ``frame``."""
        import pandas as pd

        seed = int(params.get("seed", self.cfg.seed))
        support_x, support_y, query_x = self.task(frame)
        model, cfg = self.model, self.cfg
        model.run(model.p.restore_snapshot)
        try:
            model.adapt(
                support_x,
                support_y,
                cfg.eval.inner_batch,
                cfg.eval.inner_iters,
                np.random.default_rng(seed),
            )
            logits = model.query_logits(support_x, query_x).astype(np.float64)
        finally:
            model.run(model.p.restore_snapshot)
        odds = np.exp(logits - logits.max(axis=1, keepdims=True))
        probabilities = odds / odds.sum(axis=1, keepdims=True)
        return pd.DataFrame(
            {"class": probabilities.argmax(axis=1), "probabilities": list(probabilities)}
        )

    def task(self, frame) -> tuple:
        """Support images (NCHW), their labels and the query images of a request."""
        missing = [name for name in ("image", "label") if name not in frame.columns]
        if missing:
            raise DataError(
                f"the request has no column {', '.join(missing)}: a row per image, "
                f"'image' (its {np.prod(self.image_shape)} values, H x W x C) and "
                f"'label' (0..{self.cfg.task.ways - 1} for support, {QUERY} for query)"
            )
        ways = self.cfg.task.ways
        try:
            labels = np.array([int(v) for v in frame["label"]], dtype=np.int64)
            images = np.stack(
                [np.asarray(v, dtype=np.float32).reshape(self.image_shape) for v in frame["image"]]
            )
        except (TypeError, ValueError) as err:
            raise DataError(
                f"an image must hold {np.prod(self.image_shape)} numbers "
                f"({' x '.join(map(str, self.image_shape))}) and a label an "
                f"integer: {err}"
            ) from None
        support, query = labels >= 0, labels == QUERY
        bad = sorted(set(labels[~support & ~query]) | set(labels[labels >= ways]))
        if bad:
            raise DataError(
                f"label {bad[0]} is neither a class 0..{ways - 1} nor {QUERY} (a query)"
            )
        if not query.any() or not support.any():
            raise DataError(
                "a task needs support images (label 0..ways-1) and at least one query (label -1)"
            )
        nchw = (0, 3, 1, 2)
        return (
            np.ascontiguousarray(images[support].transpose(nchw)),
            labels[support],
            np.ascontiguousarray(images[query].transpose(nchw)),
        )


def exported_image_shape(model_dir: str) -> tuple:
    """(H, W, C) of the images the exported model takes."""
    import paddle

    with paddle.static.scope_guard(paddle.static.Scope()):
        program, feeds, _ = paddle.static.load_inference_model(
            os.path.join(model_dir, MODEL_NAME), paddle.static.Executor(paddle.CPUPlace())
        )
    _, channels, height, width = program.global_block().var(feeds[0]).shape
    return height, width, channels


def load_weights(model, model_dir: str) -> None:
    """The exported weights into ``model``'s scope (an
    :class:`~kspipe.reptile.adaptation.Adapter`; they share the training names)."""
    import paddle

    scope = paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        program, _, _ = paddle.static.load_inference_model(
            os.path.join(model_dir, MODEL_NAME), model.exe
        )
    for var in program.list_vars():
        if var.persistable and var.name not in ("feed", "fetch"):
            value = np.array(scope.find_var(var.name).get_tensor())
            model.scope.var(var.name).get_tensor().set(value, paddle.CPUPlace())
    model.run(model.p.save_theta)
