"""Stage ``dataset``: the Open_KS few-shot data sets (Omniglot and mini-ImageNet layouts)."""

from __future__ import annotations

import os
import sys
from importlib import metadata

from kspipe import hookimpl
from kspipe.contracts import TrainingData
from kspipe.errors import ConfigError, DataError
from kspipe.fewshot import kanji
from kspipe.fewshot.config import DatasetConfig
from kspipe.fewshot.data import (
    SPLIT_LAYOUT,
    FewShotDataset,
    Open_KS_Character,
    Open_KS_ImageNet,
    Open_KS_read,
    read_omniglot,
)
from kspipe.fewshot.preload import decoded_mib, preload_images, verify_images
from kspipe.files import user_path

KINDS = {"omniglot": (28, 1), "miniimagenet": (84, 3)}


@hookimpl
def kspipe_config_schemas():
    return {"dataset": DatasetConfig}


@hookimpl
def kspipe_read_dataset(cfg, role):
    data = cfg.dataset
    if data.name not in KINDS:
        raise ConfigError(f"dataset.name={data.name!r} is not one of {', '.join(KINDS)}")
    default_size, channels = KINDS[data.name]
    size = data.image_size or default_size
    if role.is_server():  # a parameter server needs the image shape, not the images
        return FewShotDataset(
            name=data.name, train=[], val=[], test=[], image_shape=(size, size, channels)
        )
    root, store = data.root, None
    if root is None:
        if data.name != "omniglot":
            raise ConfigError(
                f"dataset.name={data.name} has no embedded data set: set dataset.root to its folder"
            )
        embedded = data.embedded
        root = str(
            kanji.ensure(
                characters=embedded.characters,
                drawers=embedded.drawers,
                size=size,
                seed=embedded.seed,
                cache_dir=embedded.cache_dir,
                progress=_build_progress,
                say=_say,
            )
        )
        store = os.path.join(root, f"decoded-{size}px")  # kspipe's own folder: kept there
    root = user_path(root)
    if os.path.isdir(os.path.join(root, "train")):
        kind = Open_KS_Character if data.name == "omniglot" else Open_KS_ImageNet
        cache: dict = {}
        train, val, test = Open_KS_read(kind, cache=cache, size=size).read_dataset(root)
    elif data.name == "omniglot":
        train, val, test = read_omniglot(
            root, data.train_characters, seed=cfg.seed, size=size, augment=data.augment
        )
    else:
        if not os.path.exists(root):
            raise DataError(f"data folder {root} does not exist")
        raise DataError(f"data folder {root} has no 'train' folder (expected {SPLIT_LAYOUT})")
    if decoded_mib(train, val, test) <= data.preload_mib:
        preload_images(train, val, test, store=store)  # each image decoded once: verified too
    elif data.verify:
        verify_images(train, val, test)
    return FewShotDataset(
        name=data.name,
        train=train,
        val=val,
        test=test,
        image_shape=(size, size, channels),
        root=root,
        training_data=training_data(data, root, size, (*train, *val, *test)),
    )


def training_data(data, root: str, size: int, classes) -> TrainingData:
    """The images read (a class rotated is its folder read again), named by their folder;
    the embedded set names itself, its package's version and its settings."""
    folders = {c.dir_path: c.names for c in classes}
    files = tuple(os.path.join(folder, n) for folder, names in folders.items() for n in names)
    profile = {"classes": len(folders), "images": len(files)}
    if data.root is not None:
        return TrainingData(os.path.basename(root.rstrip(os.sep)), root, files, profile=profile)
    e = data.embedded
    return TrainingData(
        "kanjivg-embedded",
        f"kanjivg {metadata.version('kanjivg')} (Python package): {e.characters} characters x "
        f"{e.drawers} drawers, seed {e.seed}, {size} px",
        files,
        profile=profile,
    )


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _build_progress(done: int, total: int) -> None:
    if done == total or done % max(1, total // 10) == 0:
        _say(f"kspipe: drawing characters {done}/{total}")
