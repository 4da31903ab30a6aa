"""Stage ``save``: export the meta-learned model with ``paddle.static.save_inference_model``.

The exported program normalises with each batch's own statistics, as training does,
so it is fed a whole task's images at once.  The config that produced the model is
written beside it (``kspipe_config.yaml``).
"""

from __future__ import annotations

import os

from kspipe import hookimpl

MODEL_NAME = "model"


@hookimpl
def kspipe_save_inference_model(cfg, role, programs, executor, scope, dirname):
    return export(cfg, dirname, programs.infer, [programs.infer_x], [programs.infer_logits],
                  executor, scope)


def export(cfg, dirname: str, program, feeds: list, fetches: list, executor, scope) -> str:
    """Save ``program`` (``feeds`` -> ``fetches``) with ``scope``'s values, and the config
    beside it; return the model's path prefix.  Every workload's save stage ends here."""
    import paddle
    from omegaconf import OmegaConf

    os.makedirs(dirname, exist_ok=True)
    prefix = os.path.join(dirname, MODEL_NAME)
    with paddle.static.scope_guard(scope):
        paddle.static.save_inference_model(prefix, feeds, fetches, executor, program=program)
    OmegaConf.save(cfg, os.path.join(dirname, "kspipe_config.yaml"), resolve=True)
    return prefix
