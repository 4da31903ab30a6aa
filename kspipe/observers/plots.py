"""The PNGs the observers attach to runs: a run's learning curve, a sweep's comparison."""

from __future__ import annotations


def learning_curve(curve: dict, path: str, headline: str = "") -> str | None:
    """Plot the ``curve/*`` series (and ``baseline_<headline>`` as a line, when reported) to
    ``path``; None if there is nothing to plot."""
    series = {k: v for k, v in curve.items() if k.startswith("curve/")}
    if not series:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    values = []
    for name, points in sorted(series.items()):
        steps, ys = zip(*points)
        values.extend(ys)
        ax.plot(steps, ys, marker="o", label=name.split("/", 1)[1])
    baseline = f"baseline_{headline}"
    if headline and baseline in curve:
        level = curve[baseline][-1][1]
        values.append(level)
        ax.axhline(level, color="grey", linestyle="--", label=baseline.replace("_", " "))
    ax.set_xlabel("step")
    if all(0 <= v <= 1 for v in values):  # accuracies, AUCs: the whole scale
        ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    return save(fig, path)


def plot_comparison(rows: list[dict], workloads: list, path: str) -> str | None:
    """Two panels, one bar per job of a sweep that reported its headline: the headline
    (error bar ``<headline>_ci95``) and the rate.  ``rows`` are the comparison's
    (:func:`kspipe.observers.sweep.comparison_row`), ``workloads`` each row's
    :class:`~kspipe.contracts.Workload`.  None if no job reported its headline."""
    done = [(r, w) for r, w in zip(rows, workloads) if w.headline and r.get(w.headline) is not None]
    if not done:
        return None
    plt = pyplot()
    several = len({w.name for _, w in done}) > 1
    labels = [r["job"] + (f" [{w.name}]" if several else "") for r, w in done]
    scores = [r[w.headline] for r, w in done]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.6 * len(done) + 2))
    left.barh(
        labels, scores, color="tab:blue", xerr=[r.get(w.headline + "_ci95") or 0 for r, w in done]
    )
    left.set_xlabel(" / ".join(label(m) for m in dict.fromkeys(w.headline for _, w in done)))
    if all(0 <= s <= 1 for s in scores):  # accuracies, AUCs: the whole scale
        left.set_xlim(0, 1)
    right.barh(
        labels, [(r.get(w.rate) if w.rate else None) or 0 for r, w in done], color="tab:orange"
    )
    right.set_xlabel(" / ".join(label(m) for m in dict.fromkeys(w.rate for _, w in done if w.rate)))
    right.set_yticklabels([])
    return save(fig, path)


def label(metric: str) -> str:
    """A metric's name for an axis: ``tasks_per_s`` is ``tasks/s``."""
    return metric.replace("_per_s", "/s").replace("_", " ")


def pyplot():
    """matplotlib's pyplot, drawing into files only (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str) -> str:
    """Write ``fig`` to ``path`` and free it; return ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
