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
def kspipe_check_config(cfg):
    """``dataset.name`` and, for a cluster job this command starts on this host, the
    layout of ``dataset.root`` (its folders listed, no image read): refused here, before
    any process starts, the job leaves no run and no run folder.  A job whose workers run
    elsewhere (other hosts, Slurm's nodes, Kubernetes' pods) has each worker check its own
    host's data as it reads it."""
    if cfg.stages.dataset != "open_ks":
        return
    data = cfg.dataset
    if data.name not in KINDS:
        raise ConfigError(f"dataset.name={data.name!r} is not one of {', '.join(KINDS)}")
    if data.root is None and data.name != "omniglot":
        raise ConfigError(
            f"dataset.name={data.name} has no embedded data set: set dataset.root to its folder"
        )
    if data.root is not None and workers_read_here(cfg):
        read_classes(data, user_path(data.root), data.image_size or KINDS[data.name][0], cfg.seed)


def workers_read_here(cfg) -> bool:
    """Whether ``cfg`` is a cluster job that this command starts, every worker on this host:
    ``workers`` a count, under kspipe's own launcher or Paddle's (not one of the job's own
    processes, which read the data in their dataset stage)."""
    from kspipe.cluster import environment
    from kspipe.cluster.endpoints import parse_endpoints

    return (
        cfg.mode in ("pserver", "collective")
        and not environment.any_given()
        and (cfg.cluster.get("launcher") or "processes") in ("processes", "paddle")
        and parse_endpoints(cfg.get("workers"), "workers") is None
    )


@hookimpl
def kspipe_read_dataset(cfg, role):
    data = cfg.dataset
    default_size, channels = KINDS[data.name]
    size = data.image_size or default_size
    if role.is_server():  # a parameter server needs the image shape, not the images
        return FewShotDataset(
            name=data.name, train=[], val=[], test=[], image_shape=(size, size, channels)
        )
    root, store = data.root, None
    if root is None:
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
    train, val, test = read_classes(data, root, size, cfg.seed, augment=data.augment)
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


def read_classes(data, root: str, size: int, seed: int, augment: bool = False) -> tuple:
    """The (train, val, test) classes of the data set in ``root``, its folders listed (no
    image read); a :class:`DataError` saying what ``root`` lacks."""
    if os.path.isdir(os.path.join(root, "train")):
        kind = Open_KS_Character if data.name == "omniglot" else Open_KS_ImageNet
        return Open_KS_read(kind, cache={}, size=size).read_dataset(root)
    if data.name == "omniglot":
        return read_omniglot(root, data.train_characters, seed=seed, size=size, augment=augment)
    if not os.path.exists(root):
        raise DataError(f"data folder {root} does not exist")
    raise DataError(f"data folder {root} has no 'train' folder (expected {SPLIT_LAYOUT})")


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
