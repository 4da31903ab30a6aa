"""The cost model of a step at cluster scale (docs/distributed.md, "Scaling: a cost model"),
fitted to bench_scale.py ``--jobs`` rows, against them, and its predictions.

    python bench/scale_model.py rows.jsonl [rows.jsonl ...] [--plot docs/scale-model.png]

A step's time is ``bytes / (e B) + hops * h``: ``bytes`` the most that one link carries
one way in the step by the strategy's topology (:func:`link_bytes`), ``B`` the links' rate,
``hops`` the hops a round's chain passes a chunk through (:func:`hops`), and three numbers
fitted to every row at once: ``e1`` the share of a shaped link one flow each way gets (two
workers, async), ``e2`` the share where a middle worker of the chain sends two flows each
way (partial sums up, totals down), and ``h`` a hop's time beyond the bytes.  On the
emulated links a chunk of an idle link passes in its token bucket's burst, so the
pipeline's fill costs no bytes' time there; on a real link each hop also waits a chunk's
time, ``c / B``, which the predictions add.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

CHUNK = 1 << 16  # kspipe/modes/summing.py's CHUNK_BYTES
GEO_K = 4  # bench_scale.py's default --k-steps
#: A geo job's rounds a timed step in the bench: rounds come every GEO_K steps, and its 5
#: timed steps after 2 of warm-up (steps 3 to 7) hold one (step 4); a long job: 1 / GEO_K.
BENCH_GEO_ROUNDS = ((2 + 5) // GEO_K - 2 // GEO_K) / 5


def link_bytes(
    kind: str, workers: int, servers: int, weights: int, geo_rounds: float, summers: bool = False
) -> float:
    """The bytes the busiest link carries one way in a step.

    * sync (and geo's rounds, ``geo_rounds`` a step): the workers' chain, float64 (8 bytes
      a weight): an end worker's link carries the array once each way, a middle worker's
      twice (the partial sums up, the totals down).  With ``summers`` (the shard summers
      beside the servers, from 3 workers on: kspipe/modes/ps/sharded.py), the chain takes
      a share f = (r - 1) / (r + 1) of the array (r = workers / servers) and the summers
      the rest, which balances a middle worker's link, (1 + f) arrays, against a server's,
      r (1 - f): 2 r / (r + 1) arrays (1 where r <= 1);
    * collective: the same chain over float32 gradients (4 bytes a weight);
    * async: each worker pushes its change and pulls the parameters (float32) every step,
      and the servers' links carry every worker's, a 1/servers share each.
    """
    if kind in ("sync", "geo"):
        arrays = 1 if workers == 2 else 2
        if summers and workers >= 3 and servers:
            ratio = workers / servers
            arrays = 2 * ratio / (ratio + 1) if ratio >= 1 else 1
        return 8 * weights * arrays * (geo_rounds if kind == "geo" else 1)
    if kind == "collective":
        return 4 * weights * (1 if workers == 2 else 2)
    return 4 * weights * max(1.0, workers / servers)


def hops(kind: str, workers: int, geo_rounds: float) -> float:
    """The hops a step's rounds pass a chunk through, up the chain and down (async: none)."""
    if kind == "async":
        return 0.0
    return 2 * (workers - 1) * (geo_rounds if kind == "geo" else 1)


def strategy(row: dict) -> tuple[str, bool]:
    """A row's strategy and whether its rounds used the shard summers: ``sync-chain`` rows
    (``cluster.shard_sum=false``) and rows measured before the summers (no ``shard_sum``)
    sum along the chain alone."""
    kind = row["kind"]
    if kind == "sync-chain":
        return "sync", False
    return kind, bool(row.get("shard_sum", False))


def terms(row: dict, geo_rounds: float = BENCH_GEO_ROUNDS) -> list[float]:
    """The model's terms that 1/e1, 1/e2 and h multiply."""
    kind, summers = strategy(row)
    args = kind, row["workers"], row["servers"], row["weights"], geo_rounds, summers
    seconds = link_bytes(*args) / (row["mbit"] * 1e6 / 8)
    two_flows = kind != "async" and row["workers"] > 2
    return [
        0.0 if two_flows else seconds,
        seconds if two_flows else 0.0,
        hops(kind, row["workers"], geo_rounds),
    ]


def fit(rows: list[dict]) -> tuple[float, float, float]:
    """(e1, e2, h) by least squares over the rows, relative errors weighed alike."""
    step = np.array([r["step_s"] for r in rows])
    a = np.array([terms(r) for r in rows]) / step[:, None]
    (one, two, h), *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    return 1 / one, 1 / two, h


def model(row: dict, fitted, geo_rounds: float = BENCH_GEO_ROUNDS, fill: float = 0.0) -> float:
    """A step's time; ``fill``: a chunk's time a hop on real links."""
    e1, e2, h = fitted
    one, two, hop_count = terms(row, geo_rounds)
    return one / e1 + two / e2 + hop_count * (h + fill)


def predict(kind: str, workers: int, weights: int, mbit: float, fitted) -> float:
    """A long job's step on real links of ``mbit`` (servers: half the workers)."""
    row = dict(
        kind=kind, workers=workers, servers=max(workers // 2, 1), weights=weights, shard_sum=True
    )
    return model(dict(row, mbit=mbit), fitted, 1 / GEO_K, CHUNK / (mbit * 1e6 / 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="+")
    parser.add_argument("--plot", default="")
    args = parser.parse_args()
    rows = []
    for path in args.rows:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    fitted = e1, e2, h = fit(rows)
    errors = [abs(model(r, fitted) / r["step_s"] - 1) for r in rows]
    print(
        f"fitted: e1 = {e1:.2f}, e2 = {e2:.2f} of a link's rate, h = {h * 1e3:.2f} ms a hop; "
        f"error median {np.median(errors):.0%}, at most {max(errors):.0%}"
    )
    print("job         weights  workers servers  measured_s  model_s")
    for r in rows:
        print(
            f"{r['kind']:<10} {r['weights']:>9}  {r['workers']:>7} {r['servers']:>7}  "
            f"{r['step_s']:10.3f}  {model(r, fitted):7.3f}"
        )
    sizes = (2, 16, 64, 256)
    for weights in (112_451, 4_000_000):
        print(f"predicted step, {weights:,} weights, links at 1 Gbit/s, servers = workers / 2:")
        for kind in ("sync", "sync-chain", "geo", "async", "collective"):
            times = [predict(kind, n, weights, 1000, fitted) for n in sizes]
            cells = "   ".join(f"{n}: {t:.3f} s" for n, t in zip(sizes, times))
            print(f"  {kind:<10} {cells}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 5))
        for kind in dict.fromkeys(r["kind"] for r in rows):
            mine = [r for r in rows if r["kind"] == kind]
            ax.loglog(
                [model(r, fitted) for r in mine], [r["step_s"] for r in mine], "o", label=kind
            )
        low = min(min(r["step_s"], model(r, fitted)) for r in rows) * 0.8
        top = max(max(r["step_s"], model(r, fitted)) for r in rows) * 1.25
        ax.plot([low, top], [low, top], "k:", lw=1)
        ax.set_xlabel("model, s a step")
        ax.set_ylabel("measured, s a step")
        ax.set_title(
            f"fitted: e1 = {e1:.2f}, e2 = {e2:.2f}, h = {h * 1e3:.2f} ms a hop", fontsize=9
        )
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
