"""The embedded default data set: Omniglot-layout characters drawn from KanjiVG strokes.

No Omniglot ships with kspipe and nothing is downloaded at run time.  The ``kanjivg``
package ships real characters as ordered pen strokes (SVG paths; CC BY-SA 3.0, KanjiVG
by Ulrich Apel).  Drawing each character's strokes with a per-"drawer" style (slant,
scale, pen width) and per-drawing jitter gives what Omniglot is: alphabets of characters,
each drawn once by each of ~20 people.  Alphabets group characters by stroke count.

The set is built deterministically from a seed, written in Omniglot's layout
(``images_background/<alphabet>/<character>/<drawing>.png``) and cached; a build that
dies leaves nothing half-written behind (it is built in a temporary folder and renamed).
"""

from __future__ import annotations

import re
import time
from importlib import metadata
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from kspipe import files
from kspipe.errors import DataError
from kspipe.files import atomic_build

SVG_SIZE = 109.0  # KanjiVG's view box
CANVAS = 64  # drawn at this size, then reduced with antialiasing
_PATH_RE = re.compile(r'<path[^>]*\sd="([^"]+)"')
_TOKEN_RE = re.compile(r"[MmCcSsLl]|-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def kanjivg_folder() -> Path:
    """The folder of KanjiVG's SVG files installed by the ``kanjivg`` package."""
    try:
        dist = metadata.distribution("kanjivg")
    except metadata.PackageNotFoundError as err:
        raise DataError(
            "the embedded data set needs the 'kanjivg' package: pip install kanjivg"
        ) from err
    folder = Path(dist.locate_file("kanji"))
    if not folder.is_dir():
        raise DataError(f"the kanjivg package has no SVG folder at {folder}")
    return folder


def parse_strokes(svg_text: str, segments: int = 8) -> list[np.ndarray]:
    """Each stroke of a KanjiVG file as an (n, 2) polyline in SVG units, in drawing order."""
    return [_flatten_path(d, segments) for d in _PATH_RE.findall(svg_text)]


def _flatten_path(d: str, segments: int) -> np.ndarray:
    tokens = _TOKEN_RE.findall(d)
    points: list[np.ndarray] = []
    pos = np.zeros(2)
    last_ctrl = None
    t = np.linspace(0.0, 1.0, segments + 1)[1:, None]
    i, cmd = 0, None
    while i < len(tokens):
        if tokens[i].isalpha():
            cmd = tokens[i]
            i += 1
        relative = cmd.islower()
        base = pos if relative else np.zeros(2)
        op = cmd.upper()
        n = {"M": 2, "L": 2, "C": 6, "S": 4}[op]
        vals = np.array([float(v) for v in tokens[i : i + n]]).reshape(-1, 2) + base
        i += n
        if op == "M":
            pos = vals[0]
            points.append(pos[None])
            last_ctrl = None
            cmd = "l" if relative else "L"  # further pairs after a move are lines
        elif op == "L":
            points.append(vals)
            pos, last_ctrl = vals[0], None
        else:
            if op == "C":
                c1, c2, end = vals
            else:  # S: first control point mirrors the previous curve's second one
                c1 = 2 * pos - last_ctrl if last_ctrl is not None else pos
                c2, end = vals
            curve = (
                (1 - t) ** 3 * pos
                + 3 * (1 - t) ** 2 * t * c1
                + 3 * (1 - t) * t**2 * c2
                + t**3 * end
            )
            points.append(curve)
            pos, last_ctrl = end, c2
    return np.concatenate(points) if points else np.zeros((0, 2))


class Drawer:
    """One person's way of drawing: a slant, a size, a pen and how steady the hand is."""

    def __init__(self, rng: np.random.Generator):
        self.rotation = rng.normal(0.0, 0.06)
        self.shear = rng.normal(0.0, 0.10)
        self.scale = rng.uniform(0.82, 1.0)
        self.width = rng.uniform(5.0, 9.0)
        self.wobble = rng.uniform(0.6, 2.0)

    def draw(self, strokes: list[np.ndarray], rng: np.random.Generator) -> Image.Image:
        angle = self.rotation + rng.normal(0.0, 0.05)
        shear = self.shear + rng.normal(0.0, 0.05)
        scale = self.scale * rng.uniform(0.93, 1.07)
        c, s = np.cos(angle), np.sin(angle)
        matrix = scale * np.array([[c, -s], [s, c]]) @ np.array([[1.0, shear], [0.0, 1.0]])
        shift = rng.normal(0.0, 3.0, size=2)
        centre = SVG_SIZE / 2
        image = Image.new("L", (CANVAS, CANVAS), 255)
        pen = ImageDraw.Draw(image)
        ratio = CANVAS / SVG_SIZE
        width = max(1, int(round(self.width * ratio * rng.uniform(0.85, 1.15))))
        for stroke in strokes:
            # a stroke drifts as a whole and trembles along its length
            drift = rng.normal(0.0, 1.5, size=2)
            tremble = np.cumsum(rng.normal(0.0, 0.35 * self.wobble, size=stroke.shape), axis=0)
            pts = stroke + drift + tremble * 0.5
            pts = (pts - centre) @ matrix.T + centre + shift
            pts = pts * ratio
            if len(pts) == 1:
                pts = np.vstack([pts, pts + 0.5])
            pen.line([tuple(p) for p in pts], fill=0, width=width, joint="curve")
        return image


def choose_characters(
    folder: Path, count: int, rng: np.random.Generator, min_strokes: int = 2, max_strokes: int = 12
) -> list[tuple[str, list]]:
    """Pick ``count`` base characters (no variants) with a moderate number of strokes."""
    candidates = []
    for path in sorted(folder.glob("*.svg")):
        if "-" in path.stem:
            continue  # KanjiVG's alternative forms of a character
        text = path.read_text(encoding="utf-8")
        if min_strokes <= text.count("<path") <= max_strokes:
            candidates.append((path.stem, text))
    if len(candidates) < count:
        raise DataError(
            f"kanjivg has only {len(candidates)} characters with "
            f"{min_strokes}-{max_strokes} strokes, fewer than {count}"
        )
    picked = rng.choice(len(candidates), size=count, replace=False)
    return [(candidates[i][0], parse_strokes(candidates[i][1])) for i in sorted(picked)]


def build(root: Path, characters: int, drawers: int, size: int, seed: int, progress=None) -> Path:
    """Write the data set under ``root`` (Omniglot layout), atomically; return ``root``."""
    rng = np.random.default_rng(seed)
    chosen = choose_characters(kanjivg_folder(), characters, rng)
    people = [Drawer(np.random.default_rng([seed, 1, d])) for d in range(drawers)]

    def draw_all(tmp: Path) -> None:
        for n, (code, strokes) in enumerate(chosen):
            alphabet = f"Strokes_{len(strokes):02d}"
            split = "images_evaluation" if len(strokes) % 3 == 0 else "images_background"
            folder = tmp / split / alphabet / f"character_{code}"
            folder.mkdir(parents=True)
            for d, person in enumerate(people):
                image = person.draw(strokes, np.random.default_rng([seed, 2, n, d]))
                image = image.resize((size, size), Image.LANCZOS)
                image.save(folder / f"{code}_{d + 1:02d}.png")
            if progress is not None:
                progress(n + 1, len(chosen))

    return atomic_build(root, draw_all, "images_background")


def ensure(
    characters: int = 1623,
    drawers: int = 20,
    size: int = 28,
    seed: int = 0,
    cache_dir: str | None = None,
    progress=None,
    say=print,
) -> Path:
    """Return the cached embedded data set for these settings, building it if needed."""
    version = metadata.version("kanjivg")
    base = files.cache_dir(cache_dir)
    root = base / f"kanjivg-{version}-c{characters}-d{drawers}-s{size}-seed{seed}"
    if (root / "images_background").is_dir():
        say(f"kspipe: using the embedded KanjiVG data set (no dataset.root given): {root}")
        return root
    base.mkdir(parents=True, exist_ok=True)
    say(
        f"kspipe: no dataset.root given: building the embedded KanjiVG data set "
        f"({characters} characters x {drawers} drawers, seed {seed}) in {root}"
    )
    start = time.perf_counter()
    build(root, characters, drawers, size, seed, progress=progress)
    say(f"kspipe: built the embedded data set in {time.perf_counter() - start:.1f} s")
    return root
