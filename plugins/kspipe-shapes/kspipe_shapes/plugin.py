"""Serves kspipe's ``dataset`` stage as ``stages.dataset=shapes``, and adds the experiment
``+experiment=shapes_5way``.

Each class is a random closed shape (3 to 8 corners, some rounded); each drawing of it
is redrawn with a wobbly hand at a random size, angle and place.  Everything is made in
memory from ``shapes.seed``: no files, no download.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from kspipe.api import ConfigError, FewShotDataset, hookimpl

DEFAULTS = {"classes": 300, "drawings": 12, "size": 28, "seed": 0}


@hookimpl
def kspipe_config_dirs():
    return ["pkg://kspipe_shapes.conf"]


@hookimpl
def kspipe_read_dataset(cfg, role):
    settings = {**DEFAULTS, **(cfg.get("shapes") or {})}
    if settings["classes"] < 2 or settings["drawings"] < 1:
        raise ConfigError(
            f"shapes.classes={settings['classes']} and shapes.drawings="
            f"{settings['drawings']} must be at least 2 and 1"
        )
    rng = np.random.default_rng(settings["seed"])
    classes = [
        ShapeClass(i, rng, settings["drawings"], settings["size"])
        for i in range(settings["classes"])
    ]
    split = max(1, len(classes) // 5)
    return FewShotDataset(
        name="shapes",
        train=classes[split:],
        val=[],
        test=classes[:split],
        image_shape=(settings["size"], settings["size"], 1),
        root=f"shapes(seed={settings['seed']})",
    )


class ShapeClass:
    """One shape, drawn ``drawings`` times; ``sample`` gives arrays like kspipe's classes."""

    def __init__(self, index: int, rng: np.random.Generator, drawings: int, size: int):
        self.dir_path = f"shape {index}"  # what kspipe's errors name
        corners = rng.integers(3, 9)
        angles = np.sort(rng.uniform(0, 2 * np.pi, corners))
        radii = rng.uniform(0.45, 1.0, corners)
        outline = np.stack([np.cos(angles) * radii, np.sin(angles) * radii], axis=1)
        self.images = np.stack([draw(outline, rng, size) for _ in range(drawings)])

    def __len__(self) -> int:
        return len(self.images)

    def sample(self, num_images: int, rng: np.random.Generator | None = None) -> np.ndarray:
        rng = rng or np.random.default_rng()
        picked = rng.choice(len(self.images), size=num_images, replace=False)
        return self.images[picked].astype(np.float32)[..., None] / 255.0


def draw(outline: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
    canvas = size * 3
    angle = rng.uniform(-0.4, 0.4)
    rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    points = outline @ rotation.T * rng.uniform(0.6, 0.9) * canvas / 2
    points += canvas / 2 + rng.normal(0, canvas * 0.04, size=2)
    points += rng.normal(0, canvas * 0.015, size=points.shape)
    image = Image.new("L", (canvas, canvas), 255)
    ImageDraw.Draw(image).line(
        [tuple(p) for p in np.vstack([points, points[:1]])],
        fill=0,
        width=int(rng.integers(4, 8)),
        joint="curve",
    )
    return np.asarray(image.resize((size, size), Image.LANCZOS))
