"""What the command checks before Hydra runs a job, each mistake in one line
(``kspipe: error: ...``) where Hydra would say it in several: the experiment's name, the
config each job composes, the run folder; and its answer to ``--help``."""

from __future__ import annotations

import os

from kspipe.cli.arguments import command_line_overrides, read_overrides, sweep_variants

USAGE = """\
kspipe: a plugin-based pipeline for distributed PaddlePaddle training

usage:
  kspipe [overrides...]        run a job (key=value, group=option, +experiment=NAME)
  kspipe -m [overrides...]     a sweep of it: one job per combination (key=a,b)
  kspipe plugins               the installed plugins, and what each adds
  kspipe datafeed --help       write and check MultiSlot files
  kspipe ctr --help            bring a stream's served model up to a later save
  kspipe --cfg job [...]       the job's config, composed, without running it
  kspipe --hydra-help          Hydra's own flags
"""

#: At most this many more compositions check the other values of a sweep (-m).
SWEEP_CHECKS = 32


def check_experiments(args: list[str], extra_dirs: list[str]) -> None:
    """Name the unknown experiment in one line, before Hydra's longer message."""
    from hydra.core.override_parser.types import ValueType

    from kspipe.errors import ConfigError

    known = available_experiments(extra_dirs)
    for override in read_overrides(args):
        if (
            override.key_or_group == "experiment"
            and not override.is_add()
            and not override.is_delete()
            and not override.package
        ):
            raise ConfigError(
                f"{override.input_line}: an experiment is added to the config: "
                f"+{override.input_line}"
            )
        if (
            override.key_or_group != "experiment"
            or override.package
            or override.is_delete()
            or override.value_type == ValueType.GLOB_CHOICE_SWEEP
        ):
            continue
        if override.is_discrete_sweep():
            names = list(override.sweep_string_iterator())
        elif override.is_sweep_override():
            continue  # interval(...): the sweeper's to refuse
        else:
            names = [override.value()]
        for name in names:
            if name is not None and str(name) not in known:
                raise ConfigError(
                    f"unknown experiment '{name}' (available: {', '.join(sorted(known))})"
                )


def available_experiments(extra_dirs: list[str]) -> set[str]:
    """The names ``+experiment=NAME`` may take: kspipe's experiments and those in the
    plugins' config folders ``extra_dirs``."""
    from importlib import resources
    from pathlib import Path

    folders = [resources.files("kspipe.conf").joinpath("experiment")]
    for entry in extra_dirs:
        if entry.startswith("pkg://"):
            package = entry[len("pkg://") :].replace("/", ".")
            folders.append(resources.files(package).joinpath("experiment"))
        else:
            folders.append(Path(entry.removeprefix("file://")) / "experiment")
    names = set()
    for folder in folders:
        if folder.is_dir():
            names.update(f.name[:-5] for f in folder.iterdir() if f.name.endswith(".yaml"))
    return names


def check_config(args: list[str], extra_dirs: list[str], schemas: dict | None = None):
    """Compose the config as Hydra is about to, so that a value of the wrong type or an
    unknown key is one line (:func:`kspipe.config.compose`), not Hydra's several.
    Returns the first job's config (None where Hydra's own flags take over).

    With ``-m`` each value of a sweep is composed once, in place of the sweep.
    """
    import itertools

    from kspipe.config import compose
    from kspipe.errors import ConfigError

    given = command_line_overrides(args)
    if given is None:
        return None
    overrides, multirun = given
    variants = sweep_variants(overrides) if multirun else [overrides]
    composed = []
    for variant in itertools.islice(variants, 1 + SWEEP_CHECKS):
        try:
            composed.append(compose(variant, extra_dirs, schemas))
        except ConfigError as err:
            raise group_hint(err, variant, extra_dirs, schemas) from None
    return composed[0] if composed else None


def group_hint(err, overrides: list[str], extra_dirs: list[str], schemas):
    """``err``, an unknown top-level key (``meta_iters=10``), naming the key of a config
    group it likely meant (``train.meta_iters=10``), where one group has it."""
    from omegaconf import DictConfig

    from kspipe.config import compose
    from kspipe.errors import ConfigError

    for given in overrides:
        key, _, value = given.partition("=")
        if "." in key or key[:1] in "+~" or not str(err).startswith(f"{given}: no such key"):
            continue
        others = [o for o in overrides if o != given]
        try:
            cfg = compose(others, extra_dirs, schemas)
        except ConfigError:
            return err
        groups = [g for g in cfg if isinstance(cfg[g], DictConfig) and key in cfg[g]]
        if groups:
            meant = " or ".join(f"{g}.{key}={value}" for g in groups)
            return ConfigError(f"{given}: no such key; did you mean {meant}?")
    return err


def check_run_folder(cfg, args: list[str]) -> None:
    """A run folder that cannot be made is one line before Paddle's import (Hydra would say
    it in two, with a hint about its own stack traces): ``run_dir`` is made now; else the
    folder the command starts in must take the time-named one (``outputs/...``)."""
    from kspipe.errors import ConfigError

    if cfg is None:
        return
    if cfg.run_dir:
        try:
            os.makedirs(os.path.expanduser(str(cfg.run_dir)), exist_ok=True)
        except OSError as err:
            raise ConfigError(
                f"run_dir={cfg.run_dir}: cannot make the run folder: {err.strerror or err}"
            ) from err
    else:  # the time-named folder goes into outputs/ here, unless hydra.run.dir says
        where = "outputs" if os.path.isdir("outputs") else os.getcwd()
        if not os.access(where, os.W_OK | os.X_OK) and not any(
            a.startswith("hydra.run.dir=") for a in args
        ):
            raise ConfigError(
                f"cannot make a run folder in {os.path.abspath(where)} (not "
                f"writable): give one with run_dir=<folder>"
            )


#: The launchers whose processes run elsewhere than on this host even when the command
#: does not hand the job off: Slurm's steps, on the nodes of the allocation.
LAUNCHED_ELSEWHERE = ("slurm",)


def check_job_size(cfg, pm) -> None:
    """A job too large is one line before anything starts (no run folder, no MLflow run,
    no process): more workers than its workload has steps to share
    (:func:`kspipe.config.size.check_work`); more processes than this host can hold
    (:func:`kspipe.config.size.check_host`), where this host's launcher starts them (not
    a scheduler's, nor a process a scheduler started as one role of a job)."""
    from kspipe.cluster import environment
    from kspipe.config import size, validate
    from kspipe.pipeline import describe_workload, process_launcher

    if cfg is None:
        return
    validate(cfg)  # workers and servers are counts or host:port lists
    size.check_work(cfg, describe_workload(pm, cfg))
    launcher = process_launcher(pm, cfg)
    if environment.any_given() or launcher.name in LAUNCHED_ELSEWHERE or launcher.hands_off(cfg):
        return
    size.check_host(cfg)


def help_text(
    args: list[str], extra_dirs: list[str], schemas: dict, modes: list[str]
) -> str | None:
    """kspipe's answer to ``--help``: how to run it, the experiments, the ``modes`` (the
    plugins that play a job's role, installed ones included) and the config the other
    arguments compose (Hydra's own help lists every config group, its schemas' included,
    in ~2 s).  None where another of Hydra's flags (``--info``, ``--config-dir`` ...) asks
    Hydra to answer."""
    from omegaconf import OmegaConf

    from kspipe.config import compose

    given = command_line_overrides([a for a in args if a not in ("-h", "--help")])
    if given is None:
        return None
    overrides, multirun = given
    if multirun:
        overrides = next(sweep_variants(overrides))
    cfg = compose(overrides, extra_dirs, schemas)
    experiments = ", ".join(sorted(available_experiments(extra_dirs)))
    return (
        f"{USAGE}\nexperiments (+experiment=NAME): {experiments}\n"
        f"modes (mode=NAME): {', '.join(modes)}\n\n"
        f"== the config{' these overrides compose' if overrides else ''} ==\n"
        f"{OmegaConf.to_yaml(cfg)}"
    )
