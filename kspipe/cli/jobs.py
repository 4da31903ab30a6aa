"""What Hydra runs for each job of the command (:class:`Jobs`), and the job's closing
line: its metrics, or how a stopped or failed run goes on."""

from __future__ import annotations

import dataclasses
import traceback

from omegaconf import open_dict

from kspipe import job as job_folders
from kspipe.cli.process import fail, reader_gone
from kspipe.errors import ClusterError, KspipeError, StorageError, first_line, print_error
from kspipe.process import stopping


class Jobs:
    """What Hydra runs for each job of the command: the one job, or each of a sweep's.

    :param pm: the plugin manager; None in a job process that Hydra's launcher started
        (submitit's Slurm jobs run :meth:`run` unpickled, without
        :func:`kspipe.cli.command.main`), which builds its own, its signal handlers and
        the config's resolvers, for its first job.
    :param swept: the keys the command's sweep varies; a sweep's job is named by its
        values of them (:func:`kspipe.observers.sweep.job_label`).
    """

    def __init__(self, pm, swept: list[str]):
        self.pm = pm
        self.swept = swept

    def __getstate__(self) -> dict:  # pickled into another process: the registry stays here
        return {"pm": None, "swept": self.swept}

    def run(self, cfg) -> float:
        """Run one job; its value (the workload's headline metric) is what a hyperparameter
        search (``hydra/sweeper=optuna``) optimises.  A sweep's job that fails says so in
        one line and returns :class:`~kspipe.observers.sweep.JobFailed`: the others run.
        A job refused before it wrote anything leaves no run folder (its MLflow run is made
        just before its execute stage: it has none either).
        A search's trial that fails (for any error: one not the user's with its traceback)
        raises :class:`~kspipe.observers.sweep.TrialFailed`, which the sweeper records as a
        failed trial."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from kspipe.config.schema import register_min_resolver
        from kspipe.observers.sweep import JobFailed, TrialFailed, is_search, job_label
        from kspipe.pipeline import hand_off, prepare, run
        from kspipe.registry.plugin_manager import get_plugin_manager

        if self.pm is None:
            stopping.install()
            self.pm = get_plugin_manager()
            register_min_resolver()  # the defaults' ${kspipe_min:...}
        hydra_cfg = HydraConfig.get()
        sweep = hydra_cfg.mode == RunMode.MULTIRUN
        job = job_label(hydra_cfg.overrides.task, self.swept) if sweep else None
        with open_dict(cfg):
            # a run's folder is Hydra's (hydra.run.dir: kspipe.job.run_folder, run_dir expanded)
            cfg.run_dir = (
                hydra_cfg.runtime.output_dir
                if not sweep
                else cfg.run_dir or hydra_cfg.runtime.output_dir
            )
            cfg.tracking.run_name = cfg.tracking.run_name or job or run_name(hydra_cfg)
            if cfg.get("isolate") is None:  # a sweep's jobs share no Paddle process state
                cfg.isolate = sweep
        try:
            handed = hand_off(cfg, self.pm, list(hydra_cfg.overrides.task))
            if handed is not None:  # a scheduler runs the job (sbatch, Kubernetes)
                print(f"kspipe: {handed}", flush=True)
                return worst_value(hydra_cfg)
            workload = prepare(cfg, self.pm)  # described once: the run and its closing line
            if not workload.groups:
                workload = dataclasses.replace(workload, groups=used_groups(self.pm, cfg))
            metrics = run(cfg, self.pm, workload)
        except KspipeError as err:
            # refused before it wrote anything: its run folder goes (its run was never made)
            job_folders.remove_unused(hydra_cfg.runtime.output_dir, own=sweep)
            if sweep:  # report, and let the other jobs run
                job = job or str(hydra_cfg.job.num)
                print_error(f"job {job}: {err}")
                if is_search(hydra_cfg):
                    raise TrialFailed(f"{job}: {err}") from None
                return JobFailed(worst_value(hydra_cfg), f"{job}: {err}")
            if isinstance(err, StorageError) or (
                isinstance(err, ClusterError) and wrote_checkpoint(cfg)
            ):  # mid-run
                err = type(err)(f"{err}{recorded_as(cfg, 'FAILED')}; {resume_hint(cfg)}")
            fail(err)
        except Exception as err:
            if not (sweep and is_search(hydra_cfg)):
                raise
            traceback.print_exc()  # not the user's mistake: where it happened
            job = f"{job or hydra_cfg.job.num}: {type(err).__name__}: {first_line(err)}"
            print_error(f"job {job}")
            raise TrialFailed(job) from err
        except KeyboardInterrupt as stop:
            stopping.exit_stopped(stop, f"{recorded_as(cfg, 'KILLED')}; {resume_hint(cfg)}")
        try:
            print_summary(cfg, metrics, workload)
        except BrokenPipeError:  # the job is done; Hydra would print it as its error
            reader_gone()
        value = metrics.get(workload.headline) if metrics else None
        return worst_value(hydra_cfg) if value is None else float(value)


def run_name(hydra_cfg) -> str | None:
    """A run's name from the command line: its experiment, then the other overrides the user
    gave (``omniglot_5way train.meta_iters=50``), without those that name a file or folder
    (Hydra's ``override_dirname.exclude_keys``: ``dataset.root``, ``run_dir`` ...); None
    for none (the tracker names it after the workload)."""
    from kspipe.observers.sweep import parse_overrides

    excluded = set(hydra_cfg.job.config.override_dirname.exclude_keys)
    given: dict[str, str] = {}  # a key given twice: its last value, where first given
    for override in parse_overrides(hydra_cfg.overrides.task) or ():
        key = override.get_key_element().lstrip("+~")
        if key not in excluded and not key.startswith("tracking."):
            given[key] = override.input_line.lstrip("+")
    experiment = given.pop("experiment", "").partition("=")[2]
    name = " ".join([experiment, *given.values()] if experiment else given.values())
    return name[:MAX_NAME] if name else None


#: A run name's length at most (MLflow's runs table shows about this much).
MAX_NAME = 200


def used_groups(pm, cfg) -> tuple:
    """The config groups the run ``cfg`` reads: every group but those that only plugins
    serving a stage the run does not give them declare (a Reptile run's ``ctr``,
    ``datafeed``, an installed workload's)."""
    from kspipe.registry.plugin_manager import STAGES, implementers

    chosen = {str(cfg.stages[stage]) for stage in STAGES}
    idle = {name for stage in STAGES for name in implementers(pm, stage)} - chosen
    declared: dict[str, set] = {}
    for impl in pm.hook.kspipe_config_schemas.get_hookimpls():
        for group in impl.function() or {}:
            declared.setdefault(group, set()).add(pm.get_name(impl.plugin))
    unused = {group for group, names in declared.items() if names <= idle}
    return tuple(key for key in cfg if key not in unused)


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
        shown.append(
            f"{name} {metrics[name]:.{digits}f}" + (f" ± {ci:.3f}" if ci is not None else "")
        )
    print("kspipe: done: " + ", ".join(shown) + f" (run folder {cfg.run_dir})", flush=True)
