"""Few-shot image data: class folders, the Open_KS readers, and the N-way K-shot sampler.

Two layouts are read:

* split folders, ``<root>/{train,val,test}/<class>/*.{png,jpg,jpeg}`` (mini-ImageNet's
  layout, and the seed's ``Open_KS_read.read_dataset``);
* Omniglot's, ``<root>/images_background/<alphabet>/<character>/*.png`` plus
  ``images_evaluation/``: all characters are shuffled with the seed, the first
  ``train_characters`` train (each also rotated by 90, 180 and 270 degrees, as in the
  Reptile paper) and the rest test.
"""

from __future__ import annotations

import copy
import os
import threading
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from kspipe.contracts import TrainingData
from kspipe.errors import DataError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")

#: What a data folder of each layout holds, as a refusal says it.
SPLIT_LAYOUT = "train/, test/ (and val/) folders of class folders of images"
OMNIGLOT_LAYOUT = (
    "<alphabet>/<character>/*.png folders, as in Omniglot's images_background/ and "
    "images_evaluation/, or " + SPLIT_LAYOUT
)


class ImageClass:
    """One class: a folder of images, sampled as float arrays in [0, 1] of shape (H, W, C).

    Decoded images are cached (as uint8, upright) by ``_read_image``; the cache is shared
    by all classes of a data set, rotated copies of a class included, and safe to fill
    from several threads.
    """

    def __init__(
        self, dir_path: str, size: int, channels: int, rotation: int = 0, cache: dict | None = None
    ):
        self.dir_path = dir_path
        self.size = size
        self.channels = channels
        self.rotation = rotation
        self._cache = {} if cache is None else cache
        try:
            names = os.listdir(dir_path)
        except OSError as err:
            raise DataError(f"cannot list class folder {dir_path}: {err.strerror}") from err
        self.names = sorted(n for n in names if n.lower().endswith(IMAGE_EXTENSIONS))

    def __len__(self) -> int:
        return len(self.names)

    def rotated(self, rotation: int) -> "ImageClass":
        """This class turned by ``rotation`` degrees: the same images and cache, its folder
        not listed again."""
        turned = copy.copy(self)
        turned.rotation = rotation
        return turned

    def __repr__(self) -> str:
        rot = f", rotation={self.rotation}" if self.rotation else ""
        return f"{type(self).__name__}({self.dir_path!r}{rot})"

    def sample(self, num_images: int, rng: np.random.Generator | None = None) -> np.ndarray:
        """``num_images`` different images of this class, shape (num_images, H, W, C)."""
        if num_images > len(self.names):
            raise DataError(
                f"class folder {self.dir_path} has {len(self.names)} images, "
                f"fewer than the {num_images} a task needs"
            )
        rng = rng or np.random.default_rng()
        picked = rng.choice(len(self.names), size=num_images, replace=False)
        return (
            np.stack([self._read_image(self.names[i]) for i in picked]).astype(np.float32) / 255.0
        )

    def _read_image(self, name: str) -> np.ndarray:
        """The image file ``name`` of this folder, decoded, resized and rotated (uint8).

        The decoded upright image is cached once for all rotations of the class; quarter
        turns of a square image are taken from it as array views (what PIL's ``rotate``
        gives for them), so sampling a task decodes nothing once its images are cached.
        """
        key = (self.dir_path, name)
        image = self._cache.get(key)
        if image is None:
            image = self._decode(os.path.join(self.dir_path, name))
            self._cache[key] = image
        if not self.rotation:
            return image
        if self.rotation % 90 == 0 and image.shape[0] == image.shape[1]:
            return np.rot90(image, self.rotation // 90)
        return self._rotate(image)

    def _decode(self, path: str) -> np.ndarray:
        mode = "L" if self.channels == 1 else "RGB"
        try:
            with Image.open(path) as im:
                im = im.convert(mode)
                if im.size != (self.size, self.size):
                    im = im.resize((self.size, self.size), resample=Image.LANCZOS)
                array = np.asarray(im, dtype=np.uint8)
        except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
            raise DataError(f"cannot read image {path}: {err}") from err
        return array.reshape(self.size, self.size, self.channels)

    def _rotate(self, image: np.ndarray) -> np.ndarray:
        """Any other rotation, by PIL (counter-clockwise, the size kept)."""
        rotated = Image.fromarray(image.squeeze(-1) if self.channels == 1 else image)
        array = np.asarray(rotated.rotate(self.rotation), dtype=np.uint8)
        return array.reshape(self.size, self.size, self.channels)


class Open_KS_Character(ImageClass):
    """A handwritten character (Omniglot): 28x28 grayscale, optionally rotated."""

    def __init__(self, dir_path: str, rotation: int = 0, cache: dict | None = None, size: int = 28):
        super().__init__(dir_path, size=size, channels=1, rotation=rotation, cache=cache)


class Open_KS_ImageNet(ImageClass):
    """An image class (mini-ImageNet): 84x84 RGB."""

    def __init__(self, dir_path: str, cache: dict | None = None, size: int = 84):
        super().__init__(dir_path, size=size, channels=3, cache=cache)


class Open_KS_read:
    """The seed's reader of split-folder data sets (``train/``, ``val/``, ``test/``)."""

    def __init__(self, class_type=Open_KS_ImageNet, **class_kwargs):
        self.class_type = class_type
        self.class_kwargs = class_kwargs

    def read_dataset(self, data_dir: str) -> tuple[list, list, list]:
        """Return the (train, val, test) class lists of ``data_dir``; ``val`` may be empty."""
        _check_folder(data_dir)
        splits = []
        for split in ("train", "val", "test"):
            path = os.path.join(data_dir, split)
            if split == "val" and not os.path.isdir(path):
                splits.append([])
                continue
            if not os.path.isdir(path):
                raise DataError(
                    f"data folder {data_dir} has no '{split}' folder (expected {SPLIT_LAYOUT})"
                )
            splits.append(self._read_classes(path))
        return tuple(splits)

    def _read_classes(self, dir_path: str) -> list:
        """One class object for each sub-folder of ``dir_path`` that holds images."""
        classes = [
            self.class_type(os.path.join(dir_path, name), **self.class_kwargs)
            for name in sorted(os.listdir(dir_path))
            if os.path.isdir(os.path.join(dir_path, name))
        ]
        classes = [c for c in classes if len(c)]
        if not classes:
            raise DataError(
                f"no class folders with images in {dir_path} (expected <class>/*.png, .jpg "
                f"or .jpeg)"
            )
        return classes


def read_omniglot(
    root: str, train_characters: int, seed: int, size: int = 28, augment: bool = True
) -> tuple[list, list, list]:
    """Read Omniglot's layout: (train, val, test) character lists, val empty."""
    _check_folder(root)
    parts = [
        os.path.join(root, p)
        for p in ("images_background", "images_evaluation")
        if os.path.isdir(os.path.join(root, p))
    ] or [root]
    cache: dict = {}
    characters = []
    for part in parts:
        for alphabet in sorted(os.listdir(part)):
            alphabet_dir = os.path.join(part, alphabet)
            if not os.path.isdir(alphabet_dir):
                continue
            for name in sorted(os.listdir(alphabet_dir)):
                path = os.path.join(alphabet_dir, name)
                if os.path.isdir(path):
                    character = Open_KS_Character(path, cache=cache, size=size)
                    if len(character):
                        characters.append(character)
    if not characters:
        raise DataError(
            f"data folder {root} is not an Omniglot data set: it has no character folders "
            f"of images (expected {OMNIGLOT_LAYOUT})"
        )
    if len(characters) <= train_characters:
        found = "character folder" + ("" if len(characters) == 1 else "s")
        raise DataError(
            f"data folder {root} has {len(characters)} {found} of images, and "
            f"dataset.train_characters={train_characters} leaves none to test on "
            f"(expected {OMNIGLOT_LAYOUT}; a smaller data set sets a smaller "
            f"dataset.train_characters)"
        )
    order = np.random.default_rng(seed).permutation(len(characters))
    train = [characters[i] for i in order[:train_characters]]
    test = [characters[i] for i in order[train_characters:]]
    if augment:
        train = [c.rotated(r) for c in train for r in (0, 90, 180, 270)]
    return train, [], test


def _check_folder(path: str) -> None:
    if not os.path.exists(path):
        raise DataError(f"data folder {path} does not exist")
    if not os.path.isdir(path):
        raise DataError(f"data path {path} is not a folder")
    if not os.listdir(path):
        raise DataError(f"data folder {path} is empty")


@dataclass
class Task:
    """One N-way K-shot task: a support set to adapt on and a query set to score."""

    support_x: np.ndarray
    support_y: np.ndarray
    query_x: np.ndarray
    query_y: np.ndarray


@dataclass
class FewShotDataset:
    """Train, validation and test classes of a few-shot data set."""

    name: str
    train: list
    val: list
    test: list
    image_shape: tuple  # (H, W, C)
    root: str = ""
    training_data: TrainingData | None = None  # the run's input in its MLflow record

    def check_task(self, ways: int, train_images: int, test_images: int) -> None:
        """Fail clearly unless each split gives ``ways`` classes of enough images."""
        for split, needed in (("train", train_images), ("test", test_images)):
            classes = getattr(self, split)
            if ways > len(classes):
                raise DataError(
                    f"task.ways={ways} is more than the {len(classes)} {split} "
                    f"classes of {self.root or self.name}"
                )
            small = [c for c in classes if len(c) < needed]
            if small:
                raise DataError(
                    f"class folder {small[0].dir_path} has {len(small[0])} images, "
                    f"fewer than the {needed} a task needs (shots + queries)"
                )


def sample_task(
    classes: list, ways: int, shots: int, queries: int, rng: np.random.Generator
) -> Task:
    """Sample ``ways`` classes, then ``shots`` support and ``queries`` query images of each.

    Labels are 0..ways-1 in the order the classes were drawn.
    """
    chosen = rng.choice(len(classes), size=ways, replace=False)
    support_x, support_y, query_x, query_y = [], [], [], []
    for label, index in enumerate(chosen):
        images = classes[index].sample(shots + queries, rng)
        support_x.append(images[:shots])
        query_x.append(images[shots:])
        support_y += [label] * shots
        query_y += [label] * queries
    return Task(
        np.concatenate(support_x),
        np.array(support_y, dtype=np.int64),
        np.concatenate(query_x),
        np.array(query_y, dtype=np.int64),
    )


class Prefetcher:
    """Produce items from ``make(i)`` for i in ``indices`` on a background thread.

    Items arrive in order; at most ``depth`` wait.  An exception in ``make`` is raised
    again in the consumer.  Each item depends only on its index, so a resumed run sees
    the same items as an uninterrupted one.
    """

    _DONE = object()

    def __init__(self, make, indices, depth: int = 4):
        import queue

        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(make, list(indices)), daemon=True)
        self._thread.start()

    def _run(self, make, indices):
        try:
            for i in indices:
                if self._stop.is_set():
                    return
                self._put((i, make(i)))
        except BaseException as err:  # handed to the consumer
            self._put(err)
            return
        self._put(self._DONE)

    def _put(self, item):
        import queue

        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self):
        while True:
            item = self._queue.get()
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
