"""The embedded KanjiVG data set: stroke parsing, drawing, the cached Omniglot layout."""

import hashlib

import numpy as np
import pytest

from kspipe.fewshot import kanji as kanji_data
from kspipe.fewshot.data import read_omniglot
from kspipe.files import files_digest


def test_parse_strokes_follows_the_pen():
    svg = (
        '<path id="s1" d="M10,20c0,0 5,0 10,0"/>'
        '<path id="s2" d="M30,40C30,40 30,50 30,60s0,10 0,20"/>'
    )
    first, second = kanji_data.parse_strokes(svg, segments=4)
    np.testing.assert_allclose(first[0], [10, 20])
    np.testing.assert_allclose(first[-1], [20, 20])
    np.testing.assert_allclose(second[0], [30, 40])
    np.testing.assert_allclose(second[-1], [30, 80])  # the relative "s" curve continues
    assert len(first) == 1 + 4 and len(second) == 1 + 8


def test_every_installed_character_parses():
    folder = kanji_data.kanjivg_folder()
    files = sorted(folder.glob("*.svg"))
    assert len(files) > 10000
    for path in files[::97]:
        strokes = kanji_data.parse_strokes(path.read_text(encoding="utf-8"))
        assert strokes and all(s.shape[1] == 2 and np.isfinite(s).all() for s in strokes), path


def _digest(root):
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.png")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def test_build_is_deterministic_and_in_omniglot_layout(tmp_path):
    a = kanji_data.ensure(
        characters=12, drawers=4, seed=3, cache_dir=str(tmp_path / "a"), say=lambda m: None
    )
    b = kanji_data.ensure(
        characters=12, drawers=4, seed=3, cache_dir=str(tmp_path / "b"), say=lambda m: None
    )
    assert _digest(a) == _digest(b)
    pngs = list(a.rglob("*.png"))
    assert len(pngs) == 12 * 4
    assert all(
        p.parent.parent.parent.name in ("images_background", "images_evaluation") for p in pngs
    )
    train, _, test = read_omniglot(str(a), train_characters=8, seed=0)
    assert len(train) == 8 * 4 and len(test) == 4
    other = kanji_data.ensure(
        characters=12, drawers=4, seed=4, cache_dir=str(tmp_path / "a"), say=lambda m: None
    )
    assert _digest(other) != _digest(a)


def test_drawers_differ_but_a_character_stays_recognisable(tmp_path):
    root = kanji_data.ensure(
        characters=6, drawers=5, seed=0, cache_dir=str(tmp_path), say=lambda m: None
    )
    train, _, test = read_omniglot(str(root), train_characters=5, seed=0, augment=False)
    chars = train + test
    images = [c.sample(5, np.random.default_rng(0)).reshape(5, -1) for c in chars]
    within = np.mean(
        [np.abs(x[i] - x[j]).mean() for x in images for i in range(5) for j in range(i)]
    )
    between = np.mean(
        [np.abs(images[a][0] - images[b][0]).mean() for a in range(len(chars)) for b in range(a)]
    )
    assert within > 0.005  # drawings of one character are not copies
    assert between > within  # but they look more alike than other characters do


def test_cached_set_is_reused(tmp_path):
    said = []
    kanji_data.ensure(characters=3, drawers=2, seed=0, cache_dir=str(tmp_path), say=said.append)
    kanji_data.ensure(characters=3, drawers=2, seed=0, cache_dir=str(tmp_path), say=said.append)
    assert "building" in said[0] and "using the embedded" in said[-1]


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(self, strokes, rng):
        raise RuntimeError("pen broke")

    monkeypatch.setattr(kanji_data.Drawer, "draw", broken)
    with pytest.raises(RuntimeError):
        kanji_data.ensure(
            characters=3, drawers=2, seed=0, cache_dir=str(tmp_path), say=lambda m: None
        )
    assert list(tmp_path.iterdir()) == []


def test_the_embedded_set_names_itself_in_the_runs_record(tmp_path):
    """Its name, its package's version and settings as its source, and the digest of the
    images read: their names (relative to the set's folder) and contents."""
    from importlib import metadata

    from kspipe.fewshot.plugin import kspipe_read_dataset
    from kspipe.role import Role
    from kspipe.testing import compose_config

    embedded = ["dataset.embedded.characters=6", "dataset.embedded.drawers=3"]
    cfg = compose_config(
        [
            "+experiment=omniglot_5way",
            *embedded,
            f"dataset.embedded.cache_dir={tmp_path}",
            "dataset.train_characters=4",
        ]
    )
    described = kspipe_read_dataset(cfg=cfg, role=Role()).training_data
    (root,) = tmp_path.glob("kanjivg-*")
    images = sorted(root.glob("images_*/*/*/*.png"))
    assert len(images) == 6 * 3
    assert described.name == "kanjivg-embedded"
    assert described.source == (
        f"kanjivg {metadata.version('kanjivg')} (Python package): 6 characters x 3 drawers, "
        f"seed 0, 28 px"
    )
    assert sorted(described.files) == [str(p) for p in images]
    assert described.profile == {"classes": 6, "images": 18}
    digest = hashlib.sha256()
    for path in images:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    assert files_digest(described.files) == digest.hexdigest()[:8]
