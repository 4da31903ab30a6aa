"""A generated click-through data set with a planted signal, in MultiSlot files.

Nothing is downloaded: the ``ctr_datafeed`` experiment trains on this set unless given
files.  Each instance is an impression with a label (click), four dense features and
three sparse slots of uint64 ids: ``user`` (one id), ``item`` (one id, Zipf-popular) and
``tags`` (one to five ids).  Every id has a hidden weight; the click probability is
``sigmoid(w_user + w_item + mean(w_tags) + v . dense + b)``, so a model that learns the
ids' embeddings and the dense weights can rank clicks well above chance (the Bayes AUC is
about 0.8).  Ids are spread over the whole uint64 range, above 2**63 included.

The set is a function of its parameters and seed, written atomically and cached.
"""

from __future__ import annotations

import os

import numpy as np

from kspipe.datafeed.desc import DataFeedDesc
from kspipe.datafeed.files import format_line
from kspipe.files import atomic_build, cache_dir

DESC_NAME = "ctr.prototxt"
VOCAB = {"user": 2000, "item": 5000, "tags": 300}
DENSE_WIDTH = 4

DESC_TEXT = (
    """name: "MultiSlotDataFeed"
batch_size: 64
multi_slot_desc {
  slots { name: "label" type: "uint64" is_dense: false is_used: true }
  slots { name: "dense" type: "float" is_dense: true is_used: true shape: -1 shape: %d }
  slots { name: "user" type: "uint64" is_dense: false is_used: true }
  slots { name: "item" type: "uint64" is_dense: false is_used: true }
  slots { name: "tags" type: "uint64" is_dense: false is_used: true }
}
"""
    % DENSE_WIDTH
)


def generate(
    folder: str,
    train_files: int = 8,
    test_files: int = 2,
    lines_per_file: int = 5000,
    seed: int = 0,
) -> str:
    """Write ``ctr.prototxt``, ``train/part-*`` and ``test/part-*`` into ``folder``."""
    rng = np.random.default_rng(seed)
    weights = {slot: rng.normal(0.0, 1.0, size) for slot, size in VOCAB.items()}
    ids = {
        slot: rng.integers(1, 1 << 64, size, dtype=np.uint64, endpoint=False)
        for slot, size in VOCAB.items()
    }
    dense_weights = rng.normal(0.0, 0.7, DENSE_WIDTH)
    item_popularity = 1.0 / np.arange(1, VOCAB["item"] + 1) ** 0.8
    item_popularity /= item_popularity.sum()
    os.makedirs(folder, exist_ok=True)
    desc = DataFeedDesc.from_text(DESC_TEXT, os.path.join(folder, DESC_NAME))
    for split, files in (("train", train_files), ("test", test_files)):
        os.makedirs(os.path.join(folder, split), exist_ok=True)
        for f in range(files):
            n = lines_per_file
            user = rng.integers(0, VOCAB["user"], n)
            item = rng.choice(VOCAB["item"], n, p=item_popularity)
            tag_counts = rng.integers(1, 6, n)
            dense = rng.normal(0.0, 1.0, (n, DENSE_WIDTH))
            with open(os.path.join(folder, split, f"part-{f:05d}"), "w") as out:
                for k in range(n):
                    tags = rng.integers(0, VOCAB["tags"], tag_counts[k])
                    logit = (
                        weights["user"][user[k]]
                        + weights["item"][item[k]]
                        + weights["tags"][tags].mean()
                        + dense[k] @ dense_weights
                        - 0.5
                    )
                    label = int(rng.random() < 1.0 / (1.0 + np.exp(-logit)))
                    out.write(
                        format_line(
                            [
                                [label],
                                dense[k],
                                [ids["user"][user[k]]],
                                [ids["item"][item[k]]],
                                ids["tags"][tags],
                            ],
                            desc.slots,
                        )
                        + "\n"
                    )
    return folder


def cached(cfg) -> str:
    """The generated set for ``cfg.datafeed.generated``, built on first use."""
    g = cfg.datafeed.generated
    folder = cache_dir(g.get("cache_dir")) / (
        f"ctr-{g.train_files}x{g.lines_per_file}-{g.test_files}-s{g.seed}"
    )
    return str(
        atomic_build(
            folder,
            lambda tmp: generate(str(tmp), g.train_files, g.test_files, g.lines_per_file, g.seed),
            DESC_NAME,
        )
    )
