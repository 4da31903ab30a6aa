"""A quick run stays quick: ``eval.tasks`` given alone (on the command line or in an
experiment) bounds every evaluation of the run, a count given for another evaluation is
kept, the shipped experiments adapt the numbers of tasks they always did, and a run says
first how many tasks each evaluation will adapt."""

from pathlib import Path

import pytest

from kspipe.pipeline import run
from kspipe.testing import HookRecorder, compose_config, plugin_manager, tiny_overrides

SHAPES = Path(__file__).resolve().parents[2] / "plugins" / "kspipe-shapes"


def counts(cfg) -> tuple[int, int, int]:
    return cfg.eval.tasks, cfg.eval.train_tasks, cfg.eval.interval_tasks


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # (eval.tasks, eval.train_tasks, eval.interval_tasks)
        ([], (200, 20, 10)),
        (["+experiment=omniglot_5way"], (100, 20, 10)),  # what it always ran
        (["+experiment=omniglot_5way_paper"], (2000, 200, 50)),
        (["+experiment=omniglot_20way_1shot"], (2000, 200, 50)),
        (["+experiment=miniimagenet_5way"], (2000, 200, 50)),
        (["+experiment=miniimagenet_5way_1shot"], (2000, 200, 50)),
        (["+experiment=miniimagenet_5way", "eval.tasks=5"], (5, 5, 5)),  # the run
        (["+experiment=omniglot_5way", "eval.tasks=5"], (5, 5, 5)),
        (["+experiment=omniglot_5way", "eval.tasks=15"], (15, 15, 10)),
        (["+experiment=omniglot_5way_paper", "eval.tasks=120"], (120, 120, 50)),
        (["eval.tasks=7"], (7, 7, 7)),
        (["+experiment=omniglot_5way", "eval.tasks=5", "eval.train_tasks=8"], (5, 8, 5)),
        (["+experiment=miniimagenet_5way", "eval.tasks=5", "eval.interval_tasks=30"], (5, 5, 30)),
        (["+experiment=omniglot_5way", "eval.train_tasks=300"], (100, 300, 10)),
    ],
)
def test_eval_tasks_given_alone_bounds_every_evaluation(overrides, expected):
    assert counts(compose_config(overrides)) == expected


def test_an_experiment_that_gives_eval_tasks_alone_bounds_the_others(monkeypatch):
    """The shapes plugin's experiment sets ``eval.tasks: 100`` and neither other count."""
    monkeypatch.syspath_prepend(str(SHAPES))
    shapes = ["+experiment=shapes_5way"]
    dirs = ["pkg://kspipe_shapes.conf"]
    assert counts(compose_config(shapes, config_dirs=dirs)) == (100, 20, 10)
    assert counts(compose_config([*shapes, "eval.tasks=4"], config_dirs=dirs)) == (4, 4, 4)


def test_a_run_says_first_how_many_tasks_each_evaluation_adapts(tmp_path, tiny_data, capsys):
    """A tiny run given ``eval.tasks=3`` alone: its first line names the counts, and each
    evaluation (the curve's points, the final one, the baseline) adapted that many tasks."""
    given = [
        o
        for o in tiny_overrides(tmp_path, tiny_data)
        if not o.startswith(("eval.train_tasks=", "eval.interval_tasks="))
    ]
    cfg = compose_config(["+experiment=omniglot_5way", *given, "tracking.enabled=false"])
    assert counts(cfg) == (3, 3, 3) and (cfg.eval.interval, cfg.train.meta_iters) == (2, 4)
    recorder = HookRecorder()
    run(cfg, plugin_manager(recorder))
    said = capsys.readouterr().err.splitlines()
    assert said[0] == (
        "kspipe: tasks per evaluation: final 3 test + 3 train, baseline 3, "
        "learning curve 3 + 3 every 2 meta-iterations"
    )
    adapted = {
        kw["task"]: kw["total"]
        for name, kw in recorder.calls
        if name == "kspipe_progress" and kw["task"] != "meta-train"
    }
    assert adapted == {
        "curve (train)": 3,
        "curve (test)": 3,
        "evaluate": 3,
        "evaluate (train)": 3,
        "baseline": 3,
    }
