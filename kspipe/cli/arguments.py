"""The command line as Hydra reads it: ``@hydra.main``'s flags and overrides, the keys a
sweep varies and the values it takes, read before Hydra runs so that the command's checks
(:mod:`kspipe.cli.checks`) see what Hydra will."""

from __future__ import annotations


def _parser():
    # The parser of @hydra.main is private (hydra._internal) and Hydra has no public one;
    # the checks must read the command line exactly as @hydra.main will.  The one use.
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.exit_on_error = False
    return parser


def hydra_command_line(args: list[str]) -> list[str]:
    """``args`` in the order ``@hydra.main``'s parser reads whole: the overrides first, then
    Hydra's flags, each with its value.  Its parser takes the overrides in one place only,
    so ``+experiment=x --cfg job train.meta_iters=3`` or ``a=1 -m b=2,3`` would leave the
    last ones unread; and ``--info`` takes the next argument only if it is one of its
    choices (``--info +experiment=x`` is the config's info with that override)."""
    options = {name: action for action in _parser()._actions for name in action.option_strings}
    overrides, flags = [], []
    rest = iter(args)
    for arg in rest:
        name, joined, _ = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        action = options.get(name)
        if action is None:  # an override (or what Hydra refuses: it says so itself)
            overrides.append(arg)
            continue
        flags.append(arg)
        if joined or action.nargs not in (None, "?"):  # --cfg=job, or a flag alone
            continue
        following = next(rest, None)
        if following is None:
            continue
        if action.nargs is None or following in (action.choices or ()):
            flags.append(following)
        else:  # --info followed by an override
            overrides.append(following)
    return [*overrides, *flags]


def hydra_arguments(args: list[str]):
    """``(namespace, unknown arguments)`` of ``args`` as ``@hydra.main`` reads them (in the
    order :func:`hydra_command_line` gives it); None where its parser would stop
    (``--version``, an argument it cannot read)."""
    import argparse

    if "--version" in args:
        return None
    try:
        return _parser().parse_known_args(hydra_command_line(args))
    except argparse.ArgumentError:
        return None


#: Hydra's flags that print something and run no job (no Paddle needed: importing it takes
#: most of a second), by their names in its parser's namespace.
ANSWERS = ("help", "hydra_help", "info", "cfg", "shell_completion")


def runs_a_job(args: list[str]) -> bool:
    """Whether the command line ``args`` may run a job: none of Hydra's flags that only
    print something (:data:`ANSWERS`, ``--version``)."""
    read = hydra_arguments(args)
    if read is None:
        return "--version" not in args  # Hydra's parser says what it cannot read
    return not any(getattr(read[0], name) for name in ANSWERS)


#: Hydra's flags of which it takes one at a time (by their names in its namespace).
EXCLUSIVE = {"run": "--run", "multirun": "-m", "cfg": "--cfg", "info": "--info"}


def check_flags(args: list[str]) -> None:
    """Two of Hydra's flags it takes one at a time (``-m --cfg job``) are one line, not
    Hydra's traceback."""
    from kspipe.errors import ConfigError

    read = hydra_arguments(args)
    given = [flag for name, flag in EXCLUSIVE.items() if read and getattr(read[0], name)]
    if len(given) > 1:
        raise ConfigError(
            f"{' and '.join(given)} together: Hydra takes one of them (--cfg and --info show "
            f"one job's config: give them without -m and a value for each swept key)"
        )


def command_line_overrides(args: list[str]):
    """``(overrides, multirun)`` as ``@hydra.main`` reads ``args``; None where Hydra's own
    flags take over (help, info, another config folder), and Hydra checks the config."""
    read = hydra_arguments(args)
    if read is None or read[1]:  # an argument Hydra refuses: it says so itself
        return None
    parsed = read[0]
    if any(
        (
            parsed.help,
            parsed.hydra_help,
            parsed.info,
            parsed.shell_completion,
            parsed.config_path,
            parsed.config_name,
            parsed.config_dir,
            parsed.experimental_rerun,
        )
    ):
        return None
    multirun = parsed.multirun or "hydra.mode=MULTIRUN" in parsed.overrides
    return parsed.overrides, multirun


def asks_for_help(args: list[str]) -> bool:
    """``--help`` (or ``-h``) as ``@hydra.main`` reads the command line."""
    read = hydra_arguments(args)
    return bool(read and read[0].help)


def read_overrides(args: list[str]) -> list:
    """The arguments Hydra reads as overrides, as its ``Override`` objects; flags, and what
    Hydra cannot read (it says so itself), are left out."""
    from kspipe.observers.sweep import parse_overrides

    return [override for arg in args for override in parse_overrides([arg]) or ()]


def swept(args: list[str]) -> list[str]:
    """The keys the sweep of the command line ``args`` varies (none where Hydra cannot
    read it)."""
    from kspipe.observers.sweep import swept_keys

    parsed = hydra_arguments(args)
    return swept_keys(parsed[0].overrides) if parsed else []


def sweep_variants(overrides: list[str]):
    """``overrides`` with each sweep at its first value, then once at each other value.

    A value's type is checked alone, so trying each once finds a bad one without composing
    every job.  ``glob(...)`` and ``interval(...)`` are left to the sweeper.
    """
    from hydra.core.override_parser.types import ValueType

    from kspipe.observers.sweep import parse_overrides

    parsed = parse_overrides(overrides)
    if parsed is None:
        yield overrides  # composing it names the mistake
        return
    first, sweeps = [], []
    for override in parsed:
        if not override.is_sweep_override():
            first.append(override.input_line)
        elif override.is_discrete_sweep() and override.value_type != ValueType.GLOB_CHOICE_SWEEP:
            key = override.get_key_element()
            values = (f"{key}={value}" for value in override.sweep_string_iterator())
            value = next(values, None)
            if value is not None:  # an empty sweep runs no job
                sweeps.append((len(first), values))
                first.append(value)
    yield first
    for i, values in sweeps:
        for value in values:
            yield first[:i] + [value] + first[i + 1 :]


def asks_for_search(args: list[str]) -> bool:
    """Whether the command line ``args`` asks for a hyperparameter search
    (``hydra/sweeper=optuna``)."""
    return any(
        override.key_or_group == "hydra/sweeper" and override.value() == "optuna"
        for override in read_overrides(args)
    )


#: What a hyperparameter search does unless the command line says: it maximises the
#: workload's headline metric, which each job returns, and goes on whatever share of its
#: trials fail (each recorded FAILED; Hydra's own default, 0.0, ends it at the first).
SEARCH_DEFAULTS = {"direction": "maximize", "max_failure_rate": 1.0}


def check_search(args: list[str]) -> None:
    """A search's ``hydra.sweeper.max_failure_rate`` out of 0..1 is refused (the sweeper
    would stop at an assertion)."""
    from kspipe.errors import ConfigError

    if not asks_for_search(args):
        return
    given = {override.key_or_group: override.value() for override in read_overrides(args)}
    rate = given.get("hydra.sweeper.max_failure_rate", 1.0)
    if not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
        raise ConfigError(
            f"hydra.sweeper.max_failure_rate={rate}: the share of a batch of trials that may "
            f"fail is a number from 0 to 1"
        )


def register_search_defaults() -> None:
    """``hydra/sweeper=optuna`` as kspipe searches (:data:`SEARCH_DEFAULTS`): the optuna
    sweeper's config with kspipe's defaults, stored in Hydra's ConfigStore in its place.
    They are the config's values then, which ``--cfg hydra`` shows as such, not overrides
    the user seems to have typed; the command line overrides them as any value."""
    import dataclasses

    from hydra.core.config_store import ConfigStore

    # stored where the sweeper's own module stores it: imported first, so that Hydra's
    # scan of its plugins, which imports it, finds it imported and stores nothing again
    from hydra_plugins.hydra_optuna_sweeper.config import Direction, OptunaSweeperConf

    defaults = dict(SEARCH_DEFAULTS, direction=Direction[SEARCH_DEFAULTS["direction"]])
    node = dataclasses.replace(OptunaSweeperConf(), **defaults)
    ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=node, provider="kspipe")
