"""A run's workload as MLflow tags: written on every run, read back by a sweep's comparison."""

from __future__ import annotations

from kspipe.contracts import Workload


def workload_tags(workload: Workload) -> dict:
    """The tags that say which workload a run ran and which of its metrics tell of it:
    ``kspipe.workload``, ``kspipe.headline``, ``kspipe.rate``, ``kspipe.summary``."""
    tags = {
        "kspipe.workload": workload.name,
        "kspipe.headline": workload.headline,
        "kspipe.rate": workload.rate,
        "kspipe.summary": ",".join(name for name in workload.shown() if name),
    }
    return {key: value for key, value in tags.items() if value}


def workload_from_tags(tags: dict) -> Workload | None:
    """The workload :func:`workload_tags` recorded; None for a run without them."""
    if not tags.get("kspipe.workload"):
        return None
    summary = tuple(name for name in tags.get("kspipe.summary", "").split(",") if name)
    return Workload(
        name=tags["kspipe.workload"],
        headline=tags.get("kspipe.headline", ""),
        rate=tags.get("kspipe.rate", ""),
        summary=summary,
    )
