"""The ``dataset`` config group of the few-shot data (``stages.dataset=open_ks``).

:class:`DatasetConfig` is the group's schema, which the plugin declares with
``kspipe_config_schemas`` (:mod:`kspipe.fewshot.plugin`): Hydra refuses a misspelt key or a
value of the wrong type while it composes the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class EmbeddedConfig:
    """The data set drawn from KanjiVG when ``dataset.root`` is null."""

    characters: int = 1623
    drawers: int = 20
    seed: int = 0
    cache_dir: Optional[str] = None  # default ~/.cache/kspipe (or $KSPIPE_CACHE_DIR)


@dataclass
class DatasetConfig:
    """Which image data set, where it is, and how it is read."""

    name: str = "omniglot"  # omniglot | miniimagenet
    root: Optional[str] = None  # null: the embedded KanjiVG data set (omniglot only)
    image_size: Optional[int] = None  # null: 28 for omniglot, 84 for miniimagenet
    train_characters: int = 1200  # Omniglot layout: characters that train; the rest test
    preload_mib: int = 512  # decode every image before training if they take at most this (MiB)
    verify: bool = True  # else open every image's header before training, to name a bad
    #                          file early
    augment: bool = True  # Omniglot layout: add 90/180/270 degree rotations of training
    #                          characters
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
