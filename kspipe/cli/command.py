"""The ``kspipe`` command: Hydra composes the config, :func:`kspipe.pipeline.run` runs it.

``kspipe [overrides...]`` runs a job (``-m`` sweeps); ``kspipe plugins`` lists plugins;
``kspipe datafeed ...`` writes and checks MultiSlot files; ``kspipe ctr refresh ...`` brings a
stream's served model up to a later save.
Mistakes the user can fix print one line, ``kspipe: error: ...``, and exit non-zero.

The command reads its arguments as Hydra will (:mod:`kspipe.cli.arguments`), checks them
(:mod:`kspipe.cli.checks`), then hands them to Hydra, which runs each job as
:class:`kspipe.cli.jobs.Jobs` says.
"""

from __future__ import annotations

import os
import sys

from kspipe.cli.arguments import (
    asks_for_help,
    asks_for_search,
    check_flags,
    check_search,
    hydra_command_line,
    read_overrides,
    register_search_defaults,
    runs_a_job,
    swept,
)
from kspipe.cli.checks import (
    check_config,
    check_experiments,
    check_job_size,
    check_run_folder,
    help_text,
)
from kspipe.cli.jobs import Jobs
from kspipe.cli.process import fail, prepare_process, reader_gone
from kspipe.cluster import environment
from kspipe.errors import KspipeError
from kspipe.process import stopping

#: the command's first arguments that name a command of their own, not a job
SUBCOMMANDS = ("plugins", "datafeed", "ctr")

#: The variable that has Hydra let an error through rather than print it (:func:`run_hydra`)
FULL_ERROR = "HYDRA_FULL_ERROR"


def main() -> None:
    """The command (``kspipe``, :mod:`kspipe.__main__`): its process set up, the checks,
    then Hydra runs the job (or each job of a sweep) as :class:`Jobs` says.  A sweep whose
    jobs failed exits non-zero from its callback
    (:class:`kspipe.observers.sweep.SweepCallback`); a search that its failed trials ended,
    in one line from here.  A stop asked for before a job begins (Ctrl-C, SIGTERM) is one
    line; a job says its own."""
    prepare_process(role=environment.any_given())  # first: no thread yet, nor Paddle
    args = sys.argv[1:]
    began = False  # whether Hydra has the jobs (a stop before is said as such)
    try:
        jobs = checked_jobs(args)
        if jobs is not None:
            began = True  # Hydra composes the jobs and runs them (here or on a scheduler)
            run_hydra(*jobs)
    except KeyboardInterrupt as stop:
        swept = end_sweep("KILLED")
        job = not (args and args[0] in SUBCOMMANDS)
        stopping.exit_stopped(stop, (" before the job began" if job and not began else "") + swept)
    except BrokenPipeError:  # `kspipe plugins | head`: the reader has what it wanted
        end_sweep("FAILED")
        reader_gone()
    except Exception as err:
        ended = failed_search(err)
        if ended is None:
            end_sweep("FAILED")
            raise
        fail(ended)
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


def failed_search(err: Exception) -> KspipeError | None:
    """``err``, out of Hydra, as one line if it is a search's end by its failed trials
    (:func:`kspipe.observers.sweep.failed_search`); else None."""
    sweep = sys.modules.get("kspipe.observers.sweep")  # loaded where a sweep may run
    return sweep.failed_search(err) if sweep is not None else None


def checked_jobs(args: list[str]):
    """The command line ``args`` up to Hydra: a subcommand runs (and exits); else the
    checks, each mistake in one line, and for a job that may run its recorder started and
    Paddle imported.  Returns what Hydra runs, ``(task, its command line)``; None where the
    command has answered itself (``--help``)."""
    from kspipe.config.schema import register_schemas
    from kspipe.job import register_resolver
    from kspipe.registry.plugin_manager import get_plugin_manager, implementers, plugin_schemas

    if args and args[0] == "plugins":  # SUBCOMMANDS
        from kspipe.cli.plugins import list_plugins

        sys.exit(list_plugins(args[1:]))
    if args and args[0] == "datafeed":
        from kspipe.datafeed.cli import main as datafeed_main

        sys.exit(datafeed_main(args[1:]))
    if args and args[0] == "ctr":
        from kspipe.cli.ctr import main as ctr_main

        sys.exit(ctr_main(args[1:]))
    stopping.end_quickly()
    runs = runs_a_job(args)
    if runs:
        stopping.handle_stop_signals()
        start_recorder(args)
    try:
        pm = get_plugin_manager()
        extra_dirs = [d for dirs in pm.hook.kspipe_config_dirs() for d in dirs]
        schemas = plugin_schemas(pm)
        check_flags(args)
        check_experiments(args, extra_dirs)
        cfg = check_config(args, extra_dirs, schemas)
        check_search(args)
        if asks_for_help(args):
            text = help_text(args, extra_dirs, schemas, implementers(pm, "role"))
            if text is not None:
                print(text)
                return None
        if runs:
            check_job_size(cfg, pm)  # before the run folder
            check_run_folder(cfg, args)
    except KspipeError as err:
        fail(err)
    if runs:
        record_early(cfg)
        stopping.install()  # Paddle's import, and its signal handlers go
    hydra_args = hydra_command_line(args)  # Hydra reads the flags anywhere on the line
    register_schemas(schemas)  # Hydra composes with them
    if asks_for_search(args):
        register_search_defaults()
    # the plugins' config folders: the search path of kspipe's config (hydra.searchpath)
    register_resolver(make=runs, config_dirs=extra_dirs)
    return Jobs(pm, swept(hydra_args)).run, hydra_args


def run_hydra(task, args: list[str]) -> None:
    """Run ``task`` under ``@hydra.main`` (kspipe's config) with the command line ``args``."""
    import hydra

    decorated = hydra.main(
        version_base="1.3", config_path="pkg://kspipe.conf", config_name="config"
    )(task)
    # @hydra.main reads its command line from sys.argv and has no public way to be given
    # another: this is the one place kspipe sets it, for this call only
    given = sys.argv
    sys.argv = [given[0], *args]
    # Hydra prints an error out of a search's sweeper as a traceback: it comes through to
    # main, which says a search its failed trials ended in one line
    full_error = os.environ.get(FULL_ERROR)
    if asks_for_search(args):
        os.environ[FULL_ERROR] = "1"
    try:
        decorated()
    finally:
        sys.argv = given
        if full_error is None:
            os.environ.pop(FULL_ERROR, None)
        else:
            os.environ[FULL_ERROR] = full_error


def start_recorder(args: list[str]) -> None:
    """Start the MLflow recorder of a job that may record its run, first thing, so that
    MLflow's import runs beside the config's composition and Paddle's import
    (:func:`kspipe.observers.mlflow.recorder.start_early`; a sweep's first job takes it).  Not
    where the command line turns tracking off, nor in a process a scheduler started as a
    job's role: its first worker records, the others never do."""
    if environment.any_given():
        return
    if any(
        override.key_or_group == "tracking.enabled" and override.value() is False
        for override in read_overrides(args)
    ):
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


if __name__ == "__main__":
    main()
