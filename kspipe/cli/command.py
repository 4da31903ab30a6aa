"""The ``kspipe`` command: Hydra composes the config, :func:`kspipe.pipeline.run` runs it.

``kspipe [overrides...]`` runs a job (``-m`` sweeps); ``kspipe plugins`` lists plugins;
``kspipe datafeed ...`` writes and checks MultiSlot files.
Mistakes the user can fix print one line, ``kspipe: error: ...``, and exit non-zero.
"""

from __future__ import annotations

import os
import sys

import kspipe.job
from kspipe.memory import cap_arenas, executor_defaults

os.environ.setdefault("GLOG_minloglevel", "2")  # keep Paddle's C++ log quiet
cap_arenas()  # before any thread starts
executor_defaults()  # before Paddle loads

import hydra  # noqa: E402
from omegaconf import open_dict  # noqa: E402

from kspipe import stopping  # noqa: E402
from kspipe.errors import ClusterError, KspipeError, StorageError, print_error  # noqa: E402
from kspipe.cluster import environment  # noqa: E402
from kspipe.schema import register_schemas  # noqa: E402

if environment.any_given():
    environment.share_cores(os.environ)  # a role a scheduler started, before Paddle loads OpenMP


def main() -> None:
    """The command (``kspipe``, :mod:`kspipe.__main__`): the checks, then Hydra runs the job
    (or each job of a sweep) as :class:`Jobs` says.  A sweep whose jobs failed exits
    non-zero from its callback (:class:`kspipe.observers.sweep.SweepCallback`).  A stop
    asked for before a job begins (Ctrl-C, SIGTERM) is one line; a job says its own."""
    args = sys.argv[1:]
    try:
        command(args)
    except KeyboardInterrupt as stop:
        swept = end_sweep("KILLED")
        job = not (args and args[0] in SUBCOMMANDS)
        stopping.exit_stopped(stop, (" before the job began" if job and not Jobs.began
                                     else "") + swept)
    except BrokenPipeError:  # `kspipe plugins | head`: the reader has what it wanted
        end_sweep("FAILED")
        reader_gone()
    except BaseException as err:  # a job's own stop exits 128 + signal once it has said so
        stopped = isinstance(err, SystemExit) and err.code in stopping.STOPPED_EXIT_CODES
        end_sweep("KILLED" if stopped else "FAILED")
        raise


def end_sweep(status: str) -> str:
    """A sweep cut short (a stop, a failure outside its jobs) ends as
    :func:`kspipe.observers.sweep.cut_short` says; what the command's last line adds.  A
    second stop meanwhile leaves it there."""
    sweep = sys.modules.get("kspipe.observers.sweep")  # loaded where a sweep may run
    try:
        return sweep.cut_short(status) if sweep is not None else ""
    except KeyboardInterrupt:
        return ""


def reader_gone() -> None:
    """The reader of the command's output is gone (``kspipe ... | head``): exit as a
    shell's own commands do, silently."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
    sys.exit(141)  # 128 + SIGPIPE


#: the command's first arguments that name a command of their own, not a job
SUBCOMMANDS = ("plugins", "datafeed")


def command(args: list[str]) -> None:
    from kspipe.plugin_manager import get_plugin_manager, implementers, plugin_schemas

    if args and args[0] == "plugins":  # SUBCOMMANDS
        from kspipe.cli.plugins import list_plugins

        sys.exit(list_plugins(args[1:]))
    if args and args[0] == "datafeed":
        from kspipe.datafeed.cli import main as datafeed_main

        sys.exit(datafeed_main(args[1:]))
    stopping.end_quickly()
    runs = not ANSWERS.intersection(args)  # a job may run
    kspipe.job.making = runs  # a command that only prints its config makes no run folder
    if runs:
        stopping.handle_stop_signals()
        start_recorder(args)
    try:
        pm = get_plugin_manager()
        extra_dirs = [d for dirs in pm.hook.kspipe_config_dirs() for d in dirs]
        schemas = plugin_schemas(pm)
        check_experiments(args, extra_dirs)
        cfg = check_config(args, extra_dirs, schemas)
    except KspipeError as err:
        fail(err)
    if asks_for_help(args):
        try:
            text = help_text(args, extra_dirs, schemas, implementers(pm, "role"))
        except KspipeError as err:
            fail(err)
        if text is not None:
            print(text)
            return
    if runs:
        try:
            check_run_folder(cfg, args)
        except KspipeError as err:
            fail(err)
        record_early(cfg)
        stopping.install()  # Paddle's import, and its signal handlers go
    if extra_dirs:
        args.append(f"hydra.searchpath=[{','.join(extra_dirs)}]")
    args += search_direction(args)
    register_schemas(schemas)  # Hydra composes with them
    Jobs.began = True  # Hydra composes the jobs and runs them (here or on a scheduler)
    run_hydra(Jobs(pm, swept(args)).run, args)


def run_hydra(task, args: list[str]) -> None:
    """Run ``task`` under ``@hydra.main`` (kspipe's config) with the command line ``args``."""
    decorated = hydra.main(version_base="1.3", config_path="pkg://kspipe.conf",
                           config_name="config")(task)
    # @hydra.main reads its command line from sys.argv and has no public way to be given
    # another: this is the one place kspipe sets it, for this call only
    given = sys.argv
    sys.argv = [given[0], *args]
    try:
        decorated()
    finally:
        sys.argv = given


#: Hydra's flags that print something and run no job (no Paddle needed: importing it takes
#: most of a second).
ANSWERS = {"--help", "-h", "--hydra-help", "--version", "--info", "-i", "--cfg", "-c",
           "--resolve", "--shell-completion", "-sc"}


USAGE = """\
kspipe: a plugin-based pipeline for distributed PaddlePaddle training

usage:
  kspipe [overrides...]        run a job (key=value, group=option, +experiment=NAME)
  kspipe -m [overrides...]     a sweep of it: one job per combination (key=a,b)
  kspipe plugins               the installed plugins, and what each adds
  kspipe datafeed --help       write and check MultiSlot files
  kspipe --cfg job [...]       the job's config, composed, without running it
  kspipe --hydra-help          Hydra's own flags
"""


def asks_for_help(args: list[str]) -> bool:
    """``--help`` (or ``-h``) as ``@hydra.main`` reads the command line."""
    read = hydra_arguments(args)
    return bool(read and read[0].help)


def help_text(args: list[str], extra_dirs: list[str], schemas: dict,
              modes: list[str]) -> str | None:
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
    return (f"{USAGE}\nexperiments (+experiment=NAME): {experiments}\n"
            f"modes (mode=NAME): {', '.join(modes)}\n\n"
            f"== the config{' these overrides compose' if overrides else ''} ==\n"
            f"{OmegaConf.to_yaml(cfg)}")


def search_direction(args: list[str]) -> list[str]:
    """A hyperparameter search (``hydra/sweeper=optuna``) maximises the workload's headline
    metric, which each job returns, unless told otherwise."""
    given = {override.key_or_group: override.value() for override in read_overrides(args)}
    if given.get("hydra/sweeper") == "optuna" and "hydra.sweeper.direction" not in given:
        return ["hydra.sweeper.direction=maximize"]
    return []


def fail(err: KspipeError) -> None:
    print_error(err)
    sys.exit(err.exit_code)


def check_experiments(args: list[str], extra_dirs: list[str]) -> None:
    """Name the unknown experiment in one line, before Hydra's longer message."""
    from hydra.core.override_parser.types import ValueType

    from kspipe.errors import ConfigError

    known = available_experiments(extra_dirs)
    for override in read_overrides(args):
        if (override.key_or_group != "experiment" or override.package or override.is_delete()
                or override.value_type == ValueType.GLOB_CHOICE_SWEEP):
            continue
        if override.is_discrete_sweep():
            names = list(override.sweep_string_iterator())
        elif override.is_sweep_override():
            continue  # interval(...): the sweeper's to refuse
        else:
            names = [override.value()]
        for name in names:
            if name is not None and str(name) not in known:
                raise ConfigError(f"unknown experiment '{name}' (available: {', '.join(sorted(known))})")


def read_overrides(args: list[str]) -> list:
    """The arguments Hydra reads as overrides, as its ``Override`` objects; flags, and what
    Hydra cannot read (it says so itself), are left out."""
    from kspipe.observers.sweep import parse_overrides

    return [override for arg in args for override in parse_overrides([arg]) or ()]


#: At most this many more compositions check the other values of a sweep (-m).
SWEEP_CHECKS = 32


def check_config(args: list[str], extra_dirs: list[str], schemas: dict | None = None):
    """Compose the config as Hydra is about to, so that a value of the wrong type or an
    unknown key is one line (:func:`kspipe.config.compose`), not Hydra's several.
    Returns the first job's config (None where Hydra's own flags take over).

    With ``-m`` each value of a sweep is composed once, in place of the sweep.
    """
    import itertools

    from kspipe.config import compose

    given = command_line_overrides(args)
    if given is None:
        return None
    overrides, multirun = given
    variants = sweep_variants(overrides) if multirun else [overrides]
    composed = [compose(variant, extra_dirs, schemas)
                for variant in itertools.islice(variants, 1 + SWEEP_CHECKS)]
    return composed[0] if composed else None


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
            raise ConfigError(f"run_dir={cfg.run_dir}: cannot make the run folder: "
                              f"{err.strerror or err}") from err
    else:  # the time-named folder goes into outputs/ here, unless hydra.run.dir says
        where = "outputs" if os.path.isdir("outputs") else os.getcwd()
        if not os.access(where, os.W_OK | os.X_OK) and not any(
                a.startswith("hydra.run.dir=") for a in args):
            raise ConfigError(f"cannot make a run folder in {os.path.abspath(where)} (not "
                              f"writable): give one with run_dir=<folder>")


def start_recorder(args: list[str]) -> None:
    """Start the MLflow recorder of a job that may record its run, first thing, so that
    MLflow's import runs beside the config's composition and Paddle's import
    (:func:`kspipe.observers.mlflow.recorder.start_early`; a sweep's first job takes it).  Not
    where the command line turns tracking off, nor in a process a scheduler started as a
    job's role: its first worker records, the others never do."""
    if environment.any_given():
        return
    if any(override.key_or_group == "tracking.enabled" and override.value() is False
           for override in read_overrides(args)):
        return
    from kspipe.observers.mlflow.recorder import start_early

    start_early()


def record_early(cfg) -> None:
    """Once the config is composed, the recorder :func:`start_recorder` started imports
    what the run's store needs, or ends if the job records nothing (``cfg`` None: Hydra
    composes it, from another config folder or name; the run takes the recorder as it is)."""
    from kspipe.observers.mlflow.recorder import end_early, prepare_early

    if cfg is None:
        return
    if not cfg.tracking.enabled:
        end_early()
        return
    from kspipe.observers.mlflow.store import tracking_uri

    prepare_early(tracking_uri(cfg))


def command_line_overrides(args: list[str]):
    """``(overrides, multirun)`` as ``@hydra.main`` reads ``args``; None where Hydra's own
    flags take over (help, info, another config folder), and Hydra checks the config."""
    read = hydra_arguments(args)
    if read is None or read[1]:  # an argument Hydra refuses: it says so itself
        return None
    parsed = read[0]
    if any((parsed.help, parsed.hydra_help, parsed.info, parsed.shell_completion,
            parsed.config_path, parsed.config_name, parsed.config_dir,
            parsed.experimental_rerun)):
        return None
    multirun = parsed.multirun or "hydra.mode=MULTIRUN" in parsed.overrides
    return parsed.overrides, multirun


def hydra_arguments(args: list[str]):
    """``(namespace, unknown arguments)`` of ``args`` as ``@hydra.main`` reads them; None
    where its parser would stop (``--version``, an argument it cannot read)."""
    import argparse

    # The parser of @hydra.main is private (hydra._internal) and Hydra has no public one;
    # the checks must read the command line exactly as @hydra.main will.  The one use.
    from hydra._internal.utils import get_args_parser

    if "--version" in args:
        return None
    parser = get_args_parser()
    parser.exit_on_error = False
    try:
        return parser.parse_known_args(args)
    except argparse.ArgumentError:
        return None


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
        elif (override.is_discrete_sweep()
              and override.value_type != ValueType.GLOB_CHOICE_SWEEP):
            key = override.get_key_element()
            values = (f"{key}={value}" for value in override.sweep_string_iterator())
            value = next(values, None)
            if value is not None:  # an empty sweep runs no job
                sweeps.append((len(first), values))
                first.append(value)
    yield first
    for i, values in sweeps:
        for value in values:
            yield first[:i] + [value] + first[i + 1:]


def available_experiments(extra_dirs: list[str]) -> set[str]:
    from importlib import resources

    folders = [resources.files("kspipe.conf").joinpath("experiment")]
    for entry in extra_dirs:
        if entry.startswith("pkg://"):
            folders.append(resources.files(entry[len("pkg://"):].replace("/", ".")).joinpath("experiment"))
        else:
            from pathlib import Path

            folders.append(Path(entry.removeprefix("file://")) / "experiment")
    names = set()
    for folder in folders:
        if folder.is_dir():
            names.update(f.name[:-5] for f in folder.iterdir() if f.name.endswith(".yaml"))
    return names


class Jobs:
    """What Hydra runs for each job of the command: the one job, or each of a sweep's.

    :param pm: the plugin manager; None in a job process that Hydra's launcher started
        (submitit's Slurm jobs run :meth:`run` unpickled, without :func:`main`), which
        builds its own, and its signal handlers, for its first job.
    :param swept: the keys the command's sweep varies; a sweep's job is named by its
        values of them (:func:`kspipe.observers.sweep.job_label`).
    """

    #: whether this command has handed its jobs to Hydra (a stop before is said as such)
    began = False

    def __init__(self, pm, swept: list[str]):
        self.pm = pm
        self.swept = swept

    def __getstate__(self) -> dict:  # pickled into another process: the registry stays here
        return {"pm": None, "swept": self.swept}

    def run(self, cfg) -> float:
        """Run one job; its value (the workload's headline metric) is what a hyperparameter
        search (``hydra/sweeper=optuna``) optimises.  A sweep's job that fails says so in
        one line and returns :class:`~kspipe.observers.sweep.JobFailed`: the others run."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from kspipe.observers.sweep import JobFailed, job_label
        from kspipe.pipeline import check, prepare, run
        from kspipe.plugin_manager import get_plugin_manager, process_launcher

        if self.pm is None:
            stopping.install()
            self.pm = get_plugin_manager()
        hydra_cfg = HydraConfig.get()
        sweep = hydra_cfg.mode == RunMode.MULTIRUN
        job = job_label(hydra_cfg.overrides.task, self.swept) if sweep else None
        with open_dict(cfg):
            # a run's folder is Hydra's (hydra.run.dir: kspipe.job.run_folder, run_dir expanded)
            cfg.run_dir = (hydra_cfg.runtime.output_dir if not sweep
                           else cfg.run_dir or hydra_cfg.runtime.output_dir)
            cfg.tracking.run_name = cfg.tracking.run_name or job
            if cfg.get("isolate") is None:  # a sweep's jobs share no Paddle process state
                cfg.isolate = sweep
        try:
            launcher = process_launcher(self.pm, cfg)
            if launcher.hands_off(cfg):  # a scheduler runs the job (sbatch, Kubernetes)
                check(cfg, self.pm)
                print(f"kspipe: {launcher.hand_off(cfg, list(hydra_cfg.overrides.task))}",
                      flush=True)
                return worst_value(hydra_cfg)
            workload = prepare(cfg, self.pm)  # described once: the run and its closing line
            metrics = run(cfg, self.pm, workload)
        except KspipeError as err:
            if sweep:  # report, and let the other jobs run
                job = job or str(hydra_cfg.job.num)
                print_error(f"job {job}: {err}")
                return JobFailed(worst_value(hydra_cfg), f"{job}: {err}")
            if isinstance(err, StorageError) or (isinstance(err, ClusterError)
                                                 and wrote_checkpoint(cfg)):  # mid-run
                err = type(err)(f"{err}{recorded_as(cfg, 'FAILED')}; {resume_hint(cfg)}")
            fail(err)
        except KeyboardInterrupt as stop:
            stopping.exit_stopped(stop, f"{recorded_as(cfg, 'KILLED')}; {resume_hint(cfg)}")
        try:
            print_summary(cfg, metrics, workload)
        except BrokenPipeError:  # the job is done; Hydra would print it as its error
            reader_gone()
        value = metrics.get(workload.headline) if metrics else None
        return worst_value(hydra_cfg) if value is None else float(value)


def recorded_as(cfg, status: str) -> str:
    """What a stopped or failed run's line says of its MLflow run, if it is recorded."""
    return f"; the run is recorded as {status}" if cfg.tracking.enabled else ""


def wrote_checkpoint(cfg) -> bool:
    from kspipe import checkpoint

    try:
        checkpoint.latest(cfg.run_dir)
    except KspipeError:
        return False
    return True


def resume_hint(cfg) -> str:
    """How a stopped run goes on: from its latest checkpoint, if it wrote one."""
    if wrote_checkpoint(cfg):
        return f"resume={cfg.run_dir} continues from its latest checkpoint"
    if cfg.get("resume"):
        return f"it wrote no checkpoint: resume={cfg.resume} again starts where it did"
    return "it wrote no checkpoint to resume from"


def worst_value(hydra_cfg) -> float:
    """What a job without its headline metric (a failed one) gives a hyperparameter search:
    the worst value, so the search goes on (optuna stops at a NaN)."""
    direction = str(hydra_cfg.sweeper.get("direction", "maximize")).lower()
    return float("inf") if "minimize" in direction else float("-inf")


def print_summary(cfg, metrics: dict, workload) -> None:
    """The closing line: the metrics ``workload`` names (its headline and rate first)."""
    if not metrics:  # a host of a job across hosts without worker 0
        print(f"kspipe: done: this host's part (run folder {cfg.run_dir})", flush=True)
        return
    shown = []
    for name in workload.shown():
        if name not in metrics:
            continue
        ci = metrics.get(name + "_ci95")
        digits = 1 if name == workload.rate else 3
        shown.append(f"{name} {metrics[name]:.{digits}f}" + (f" ± {ci:.3f}" if ci is not None else ""))
    print("kspipe: done: " + ", ".join(shown) + f" (run folder {cfg.run_dir})", flush=True)


if __name__ == "__main__":
    main()
