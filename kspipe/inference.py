"""The one export of an inference model, for every workload's save stage:
``paddle.static.save_inference_model`` with the config that produced it beside it
(``kspipe_config.yaml``)."""

from __future__ import annotations

import os

MODEL_NAME = "model"


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
