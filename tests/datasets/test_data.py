"""The Open_KS readers, the task sampler and the prefetcher, on real image files.
Checked through the public names only: what a class's ``sample`` gives is what its reading
of an image (decoding, rotation, the shared cache) did."""

import numpy as np
import pytest
from PIL import Image

from kspipe.errors import DataError
from kspipe.fewshot.data import (
    Open_KS_Character,
    Open_KS_ImageNet,
    Open_KS_read,
    Prefetcher,
    read_omniglot,
    sample_task,
)


def write_images(folder, count, size, mode, ext=".png", seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shape = (size, size) if mode == "L" else (size, size, 3)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(
            folder / f"img{i}{ext}"
        )


@pytest.fixture
def imagenet_like(tmp_path):
    for split, classes in (("train", 4), ("val", 2), ("test", 3)):
        for c in range(classes):
            ext = ".JPEG" if c % 2 else ".jpg"
            write_images(tmp_path / split / f"n0{split}{c}", 5, 100, "RGB", ext, seed=c)
    return tmp_path


def test_read_dataset_split_layout(imagenet_like):
    train, val, test = Open_KS_read(Open_KS_ImageNet).read_dataset(str(imagenet_like))
    assert (len(train), len(val), len(test)) == (4, 2, 3)
    images = train[1].sample(3, np.random.default_rng(0))
    assert images.shape == (3, 84, 84, 3) and images.dtype == np.float32
    assert 0.0 <= images.min() and images.max() <= 1.0


def test_read_dataset_skips_folders_without_images(imagenet_like):
    (imagenet_like / "train" / "empty").mkdir()
    (imagenet_like / "train" / "notes.txt").write_text("not a class")
    train, _, _ = Open_KS_read().read_dataset(str(imagenet_like))
    assert [c.dir_path.rsplit("/", 1)[1] for c in train] == [f"n0train{i}" for i in range(4)]


def test_omniglot_layout_split_and_rotations(tmp_path):
    for part, alphabets in (("images_background", 2), ("images_evaluation", 1)):
        for a in range(alphabets):
            for c in range(4):
                write_images(tmp_path / part / f"alpha{a}" / f"character{c:02d}", 3, 105, "L")
    train, val, test = read_omniglot(str(tmp_path), train_characters=8, seed=1)
    assert len(train) == 8 * 4 and val == [] and len(test) == 4
    assert sorted({c.rotation for c in train}) == [0, 90, 180, 270]
    assert {c.dir_path for c in train}.isdisjoint({c.dir_path for c in test})
    image = train[0].sample(1)[0]
    assert image.shape == (28, 28, 1)


def test_rotation_rotates_the_image(tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    array = np.zeros((28, 28), np.uint8)
    array[:, :5] = 255  # a bar on the left
    Image.fromarray(array).save(folder / "a.png")
    plain = Open_KS_Character(str(folder)).sample(1)[0, ..., 0]
    turned = Open_KS_Character(str(folder), rotation=180).sample(1)[0, ..., 0]
    assert plain[:, :5].mean() == 1.0 and turned[:, -5:].mean() == 1.0


@pytest.mark.parametrize("rotation", [90, 180, 270, 45])
def test_rotations_are_pils_from_one_cached_decode(tmp_path, rotation):
    write_images(tmp_path / "c", 1, 28, "L")
    cache = {}
    upright = Open_KS_Character(str(tmp_path / "c"), cache=cache).sample(1)
    turned = Open_KS_Character(str(tmp_path / "c"), rotation=rotation, cache=cache).sample(1)
    with Image.open(tmp_path / "c" / "img0.png") as im:
        expected = np.asarray(im.convert("L").rotate(rotation))
    np.testing.assert_array_equal(turned[0, ..., 0], expected.astype(np.float32) / 255.0)
    assert len(cache) == 1 and not np.array_equal(turned, upright)


def test_sampling_caches_decoded_images(tmp_path):
    write_images(tmp_path / "c", 2, 28, "L")
    character = Open_KS_Character(str(tmp_path / "c"))
    first = character.sample(2, np.random.default_rng(0))
    for image in (tmp_path / "c").iterdir():
        image.unlink()  # a cached image is not read again
    np.testing.assert_array_equal(character.sample(2, np.random.default_rng(0)), first)


def test_sample_task_shapes_and_labels(tmp_path):
    classes = []
    for c in range(6):
        write_images(tmp_path / f"c{c}", 5, 28, "L", seed=c)
        classes.append(Open_KS_Character(str(tmp_path / f"c{c}")))
    task = sample_task(classes, ways=4, shots=3, queries=2, rng=np.random.default_rng(0))
    assert task.support_x.shape == (12, 28, 28, 1) and task.query_x.shape == (8, 28, 28, 1)
    assert list(task.support_y) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert list(task.query_y) == [0, 0, 1, 1, 2, 2, 3, 3]
    again = sample_task(classes, ways=4, shots=3, queries=2, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(task.support_x, again.support_x)


def test_corrupt_image_names_the_file(tmp_path):
    folder = tmp_path / "c"
    write_images(folder, 2, 28, "L")
    (folder / "img1.png").write_bytes(b"not a png at all")
    character = Open_KS_Character(str(folder))
    with pytest.raises(DataError, match="cannot read image .*img1.png"):
        character.sample(2)


def test_too_few_images_for_a_task(tmp_path):
    write_images(tmp_path / "c", 2, 28, "L")
    with pytest.raises(DataError, match=r"has 2 images, fewer than the 3"):
        Open_KS_Character(str(tmp_path / "c")).sample(3)


@pytest.mark.parametrize(
    "reader",
    [
        lambda root: Open_KS_read().read_dataset(root),
        lambda root: read_omniglot(root, train_characters=1, seed=0),
    ],
)
def test_missing_or_empty_folder(tmp_path, reader):
    with pytest.raises(DataError, match="missing does not exist"):
        reader(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty is empty"):
        reader(str(tmp_path / "empty"))


def test_split_layout_needs_train_and_test(tmp_path):
    write_images(tmp_path / "train" / "a", 2, 28, "L")
    with pytest.raises(DataError, match="has no 'test' folder"):
        Open_KS_read().read_dataset(str(tmp_path))


def test_prefetcher_keeps_order_and_raises_errors():
    def make(i):
        if i == 5:
            raise DataError("bad item 5")
        return i * i

    seen = []
    feed = Prefetcher(make, range(10), depth=2)
    with pytest.raises(DataError, match="bad item 5"):
        for i, value in feed:
            seen.append((i, value))
    feed.close()
    assert seen == [(i, i * i) for i in range(5)]


def test_preloading_decodes_each_file_once_and_names_a_bad_one(tmp_path, monkeypatch):
    from kspipe.fewshot.preload import decoded_mib, preload_images

    for c in range(3):
        write_images(tmp_path / "images_background" / "alpha" / f"character{c}", 4, 28, "L", seed=c)
    train, _, test = read_omniglot(str(tmp_path), train_characters=2, seed=0)
    assert len(train) == 8 and len(test) == 1  # two characters, four rotations each
    assert decoded_mib(train, test) == pytest.approx(3 * 4 * 28 * 28 / 2**20)
    opened, open_image = [], Image.open

    def counted_open(path, *args):
        opened.append(path)
        return open_image(path, *args)

    monkeypatch.setattr(Image, "open", counted_open)
    assert preload_images(train, test) == 12
    assert len(opened) == len(set(opened)) == 12  # each file once
    opened.clear()
    for character in train + test:  # every rotation samples from what was decoded
        character.sample(4)
    assert opened == []
    (tmp_path / "images_background" / "alpha" / "character0" / "img0.png").write_bytes(
        b"\x89PNG broken"
    )
    fresh, _, more = read_omniglot(str(tmp_path), train_characters=2, seed=0)
    with pytest.raises(DataError, match="cannot read image .*img0.png"):
        preload_images(fresh, more)


def test_a_store_keeps_the_decoded_images_for_the_next_run(tmp_path, monkeypatch):
    """The next read of the same files decodes nothing and samples the same arrays; other
    files (one renamed) are decoded again, never served from the store."""
    from kspipe.fewshot.preload import preload_images

    for c in range(3):
        write_images(tmp_path / "images_background" / "alpha" / f"character{c}", 4, 28, "L", seed=c)
    store = str(tmp_path / "decoded-28px")
    first, _, first_test = read_omniglot(str(tmp_path), train_characters=2, seed=0)
    assert preload_images(first, first_test, store=store) == 12
    assert len(list(tmp_path.glob("decoded-28px-*.npy"))) == 1
    opened, open_image = [], Image.open

    def counted_open(path, *args):
        opened.append(path)
        return open_image(path, *args)

    monkeypatch.setattr(Image, "open", counted_open)
    again, _, again_test = read_omniglot(str(tmp_path), train_characters=2, seed=0)
    assert preload_images(again, again_test, store=store) == 12
    for a, b in zip(first + first_test, again + again_test):
        np.testing.assert_array_equal(
            a.sample(4, np.random.default_rng(1)), b.sample(4, np.random.default_rng(1))
        )
    assert opened == []
    folder = tmp_path / "images_background" / "alpha" / "character1"
    (folder / "img0.png").rename(folder / "img9.png")
    renamed, _, renamed_test = read_omniglot(str(tmp_path), train_characters=2, seed=0)
    assert preload_images(renamed, renamed_test, store=store) == 12
    assert len(opened) == 12


def test_a_folder_that_is_no_data_set_says_what_was_expected(tmp_path):
    """A folder such as /tmp, which holds a few images somewhere, is refused with the
    layouts it was read for, not only a count of what was found."""
    write_images(tmp_path / "downloads" / "pictures", 3, 28, "L")
    with pytest.raises(DataError) as refused:
        read_omniglot(str(tmp_path), train_characters=1200, seed=0)
    line = str(refused.value)
    assert "\n" not in line and "1 character folder of images" in line
    for expected in ("<alphabet>/<character>/*.png", "images_background/", "train/, test/"):
        assert expected in line
    with pytest.raises(DataError, match=r"no character folders .*expected <alphabet>"):
        read_omniglot(str(tmp_path / "downloads" / "pictures"), train_characters=1, seed=0)
    with pytest.raises(DataError, match=r"has no 'train' folder \(expected train/, test/"):
        Open_KS_read().read_dataset(str(tmp_path / "downloads"))
