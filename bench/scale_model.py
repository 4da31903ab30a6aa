"""The cost model of a step at cluster scale (docs/distributed.md, "Scaling: a cost model"),
fitted to bench_scale.py ``--jobs`` rows, against them, and its predictions.

    python bench/scale_model.py rows.jsonl [--plot docs/scale-model.png]

A step's time is ``t0 + bytes / (e * B) + hops * h + a * weights * shared``: ``bytes`` the
most that one link carries one way in the step by the strategy's topology, the pipeline's
fill included (:func:`link_bytes`), ``B`` the links' rate, ``hops`` the chunk hops a
round's pipeline fills (:func:`hops`), and ``shared`` how many processes share a core
(here, all of a job's on this machine's ``CORES``: the emulation's own cost, which on
machines of their own is 1).  Four numbers are fitted to every row at once: ``e`` the share
of a shaped link that TCP gets, ``h`` a hop's time beyond its bytes, ``t0`` a step's fixed
time, ``a`` a worker's own work a step per weight (its compute, and the exchange's copies
and sums).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

CHUNK = 1 << 16  # kspipe/modes/summing.py's CHUNK_BYTES
GEO_K = 4  # bench_scale.py's default --k-steps
CORES = 2  # this machine's: every emulated host's processes share them


def link_bytes(kind: str, workers: int, servers: int, weights: int) -> float:
    """The bytes the busiest link carries one way in a step.

    * sync (and a geo round): the workers' chain, float64 (8 bytes a weight): an end
      worker's link carries the array once each way, a middle worker's twice (the partial
      sums up, the totals down);
    * collective: the same chain over float32 gradients (4 bytes a weight);
    * async: each worker pushes its change and pulls the parameters (float32) every step,
      and the servers' links carry every worker's, a 1/servers share each.
    """
    if kind in ("sync", "geo"):
        size = 8 * weights * (1 if workers == 2 else 2)
        return size / (GEO_K if kind == "geo" else 1)
    if kind == "collective":
        return 4 * weights * (1 if workers == 2 else 2)
    return 4 * weights * max(1.0, workers / servers)


def hops(kind: str, workers: int) -> float:
    """Chunk hops a step's round waits for before its links are all busy (async: none)."""
    if kind == "async":
        return 0.0
    return 2 * (workers - 1) / (GEO_K if kind == "geo" else 1)


def columns(kind, workers, servers, weights, mbit, cores) -> list[float]:
    """The model's terms that its fitted numbers multiply: 1/e, h, t0, a."""
    rate = mbit * 1e6 / 8
    moved = link_bytes(kind, workers, servers, weights) + hops(kind, workers) * CHUNK
    processes = workers + (0 if kind == "collective" else servers)
    return [moved / rate, hops(kind, workers), 1.0, weights * max(1.0, processes / cores)]


def fit(rows: list[dict]) -> tuple[float, float, float, float]:
    """(e, h, t0, a) by least squares over the rows (relative errors weighed alike)."""
    step = np.array([r["step_s"] for r in rows])
    terms = np.array(
        [
            columns(r["kind"], r["workers"], r["servers"], r["weights"], r["mbit"], CORES)
            for r in rows
        ]
    )
    weights = 1 / step
    (inverse_e, h, t0, a), *_ = np.linalg.lstsq(
        terms * weights[:, None], step * weights, rcond=None
    )
    return 1 / inverse_e, h, t0, a


def predict(kind, workers, servers, weights, mbit, fitted, cores=CORES) -> float:
    """A step's time; ``cores``: each process's share of a machine (``float("inf")``: a
    machine of its own)."""
    e, h, t0, a = fitted
    return float(np.dot(columns(kind, workers, servers, weights, mbit, cores), [1 / e, h, t0, a]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows")
    parser.add_argument("--plot", default="")
    args = parser.parse_args()
    with open(args.rows) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    fitted = e, h, t0, a = fit(rows)
    print(
        f"fitted: e = {e:.2f} of a link's rate, h = {h * 1e3:.2f} ms a hop, "
        f"t0 = {t0:.3f} s, a = {a * 1e9:.1f} ns a weight"
    )
    print("job         weights  workers servers  measured_s  model_s")
    for r in rows:
        model = predict(r["kind"], r["workers"], r["servers"], r["weights"], r["mbit"], fitted)
        r["model_s"] = model
        print(
            f"{r['kind']:<10} {r['weights']:>9}  {r['workers']:>7} {r['servers']:>7}  "
            f"{r['step_s']:10.3f}  {model:7.3f}"
        )
    for weights in (112_451, 4_000_000):
        print(
            f"predicted, {weights:,} weights, links at 1 Gbit/s, a machine a process, "
            f"servers = workers / 2:"
        )
        for kind in ("sync", "geo", "async", "collective"):
            times = [
                predict(kind, n, n // 2, weights, 1000, fitted, float("inf"))
                for n in (2, 16, 64, 256)
            ]
            print(
                f"  {kind:<10} "
                + "   ".join(f"{n}: {t:.3f} s" for n, t in zip((2, 16, 64, 256), times))
            )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 5))
        for kind in dict.fromkeys(r["kind"] for r in rows):
            mine = [r for r in rows if r["kind"] == kind]
            ax.plot([r["model_s"] for r in mine], [r["step_s"] for r in mine], "o", label=kind)
        top = max(max(r["step_s"], r["model_s"]) for r in rows) * 1.1
        ax.plot([0, top], [0, top], "k:", lw=1)
        ax.set_xlabel("model, s a step")
        ax.set_ylabel("measured, s a step")
        ax.set_title(
            f"fitted: e = {e:.2f}, h = {h * 1e3:.2f} ms, t0 = {t0:.2f} s, "
            f"a = {a * 1e9:.0f} ns/weight",
            fontsize=9,
        )
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
