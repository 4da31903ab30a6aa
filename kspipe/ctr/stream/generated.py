"""A generated stream in PaddleRec's online layout, for tests and ``bench/bench_stream.py``.

Each line is PaddleRec's slot format: ``<label>:1`` then one ``feasign:slot`` id for each
of the slots 2, 3 and 4.  Ids are Zipf distributed over a popular set that drifts: on day
``d`` slot ``k`` draws ranks from a Zipf law and rank ``r`` is id ``base_k + d * drift + r``,
so each day ``drift`` new ids arrive at the top and as many fade out.  The id a line
holds is that number mixed over the whole uint64 range (a bijection: distinct numbers stay
distinct ids, about half of them at or above 2**63), as real hashed feasigns are.  A hidden
weight per id (a hash of it) sets the click probability, so a model can learn it.
"""

from __future__ import annotations

import datetime
import os

import numpy as np

SLOT_BASES = {2: 1 << 20, 3: 1 << 40, 4: (1 << 63) + 7}


def spread(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 that spreads neighbours apart."""
    z = values.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def weight(ids: np.ndarray) -> np.ndarray:
    """A hidden weight in [-1.5, 1.5] for each id, the same for an id everywhere."""
    with np.errstate(over="ignore"):
        mixed = (ids * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    return (mixed % np.uint64(1000)).astype(np.float64) / 1000 * 3 - 1.5


def write_stream(
    root: str,
    start_day: str,
    days: int,
    folders: list,
    lines: int,
    files: int = 2,
    drift: int = 200,
    zipf: float = 1.2,
    vocabulary: int = 5000,
    seed: int = 0,
    donefile: str | None = None,
) -> list[str]:
    """Write ``days`` days from ``start_day``, each with the HHMM ``folders``, each folder
    ``files`` files of ``lines`` lines in all; returns the days written."""
    rng = np.random.default_rng(seed)
    first = datetime.datetime.strptime(start_day, "%Y%m%d").date()
    written = []
    for d in range(days):
        day = (first + datetime.timedelta(days=d)).strftime("%Y%m%d")
        written.append(day)
        for name in folders:
            folder = os.path.join(root, day, name)
            os.makedirs(folder, exist_ok=True)
            columns = {}
            for slot, base in SLOT_BASES.items():
                rank = np.minimum(rng.zipf(zipf, lines), vocabulary) - 1
                number = np.uint64(base) + np.uint64(d * drift) + rank.astype(np.uint64)
                columns[slot] = spread(number)
            logit = sum(weight(ids) for ids in columns.values()) - 0.5
            labels = (rng.random(lines) < 1 / (1 + np.exp(-logit))).astype(int)
            text = [
                f"{labels[i]}:1 " + " ".join(f"{columns[s][i]}:{s}" for s in SLOT_BASES)
                for i in range(lines)
            ]
            for f in range(files):
                with open(os.path.join(folder, f"part-{f:05d}"), "w") as out:
                    out.write("\n".join(text[f::files]) + "\n")
            if donefile:
                open(os.path.join(folder, donefile), "w").close()
    return written
