"""Mode ``collective``: data-parallel workers whose programs all-reduce, for any workload.

Started without ``PADDLE_TRAINER_ID`` in the environment, the role stage is a cluster job
that starts ``workers`` processes (one per GPU of ``devices`` on a GPU build) with
Paddle's collective environment contract (``PADDLE_TRAINER_ID``,
``PADDLE_TRAINER_ENDPOINTS``, ``PADDLE_CURRENT_ENDPOINT``).

The reductions are Paddle's own collective ops in the programs (``c_allreduce_sum`` on
ring 0), as Paddle's RawProgramOptimizer writes them:

* ``distributed_optimizer(opt)``: after the backward ops, the gradients are summed over the
  workers in one exchange and scaled by 1/workers (:mod:`kspipe.modes.fused`: one buffer,
  one collective, one scale), then the optimiser applies the mean gradient: every worker
  takes the same step, that of one process over the workers' batches together;
* ``parameter_sync(shapes)``: after a workload's own update (Reptile's meta step) its
  parameters are averaged over the workers the same way, in one exchange (LocalSGD);
* at ``init_worker`` worker 0's parameters reach every worker (an all-reduce of them
  and zeros), so all start from the same model.

On CPU the ops' kernels run over gloo (:func:`kspipe.cluster.meeting.gloo_context`, worker 0
serves the meeting point); on a GPU build over an NCCL ring that ``c_gen_nccl_id`` +
``c_comm_init`` set up, the reductions on the GPUs.  (Fleet's collective optimiser cannot
be used on CPU: it fails setting up the communicator, ``c_gen_nccl_id`` / comm_id.)
"""

from __future__ import annotations

import numpy as np

from kspipe import hookimpl
from kspipe.checkpoint.resizing import resize_line
from kspipe.cluster import environment
from kspipe.cluster.endpoints import process_count
from kspipe.errors import ConfigError
from kspipe.launchers.hosts import job_hosts
from kspipe.modes.config import ModeConfig
from kspipe.modes.fused import append_scale, append_sum
from kspipe.modes.job import ClusterJob
from kspipe.modes.role import ParameterSync, Role, check_reduce_mode, read_vars, write_vars
from kspipe.process import heartbeat


@hookimpl
def kspipe_config_schemas():
    """The modes' keys of the cluster group (the launchers' are theirs)."""
    return {"cluster": ModeConfig}


@hookimpl
def kspipe_assign_role(cfg, launcher):
    devices = gpu_devices(cfg)
    if environment.given("collective"):
        environment.check("collective")
        return CollectiveRole()
    return CollectiveJob(cfg, devices, launcher)


def gpu_devices(cfg) -> list[int]:
    """The GPUs to run on: ``devices`` (a list or "0,1"), all visible ones, or none (CPU)."""
    import paddle

    wanted = cfg.get("devices")
    compiled = paddle.is_compiled_with_cuda()
    if wanted is None:
        return list(range(paddle.device.cuda.device_count())) if compiled else []
    if isinstance(wanted, int):
        ids = [wanted]
    elif isinstance(wanted, str):
        ids = [int(d) for d in wanted.replace(" ", "").split(",") if d]
    else:
        ids = [int(d) for d in wanted]
    if not compiled:
        raise ConfigError(
            f"devices={wanted}: this Paddle is a CPU build, so NCCL is not "
            f"available; install paddlepaddle-gpu==2.6.2, or leave devices unset "
            f"to run the collective mode on CPU through gloo"
        )
    count = paddle.device.cuda.device_count()
    missing = [d for d in ids if d < 0 or d >= count]
    if missing:
        raise ConfigError(
            f"devices={wanted}: no GPU {', '.join(map(str, missing))} here ({count} visible)"
        )
    return ids


REFUSED = {
    "dataset_training": "train_from_dataset's reader threads each take their own number of "
    "steps, so a per-step all-reduce across workers would wait forever",
    "sparse_tables": "an embedding table's sparse gradient has no all-reduce here; use "
    "mode=pserver, which keeps such tables on the servers",
}


def refusal(needs) -> str | None:
    """Why a collective job cannot run a workload that ``needs`` these; None if it can."""
    return "; ".join(REFUSED[n] for n in sorted(needs) if n in REFUSED) or None


class CollectiveRole(Role):
    """One worker of a collective job, read from Paddle's environment variables."""

    mode = "collective"

    def __init__(self):
        super().__init__()
        import paddle

        paddle.enable_static()
        place = environment.collective_place()
        self.rank, self.endpoints, self.nranks = place.rank, place.endpoints, place.nranks
        selected = place.device
        self.device = int(selected) if selected and paddle.is_compiled_with_cuda() else None
        self._nccl_ready = False
        # the collective ops go into the programs with two workers or more, and on a GPU
        # always (a ring of one still sets up NCCL and runs the ops: the GPU path)
        self.reduces = self.nranks > 1 or self.device is not None
        self.gloo = self.book = None  # the workers' gloo world; worker 0: its meeting point
        self.chain = None  # the workers' chain of sockets (WorkerSum), once a sum needs it
        if self.nranks > 1:
            from kspipe.cluster.meeting import gloo_context

            self.gloo, self.book = gloo_context(self.rank, self.nranks, place.meeting)

    # who am I
    def worker_num(self):
        return self.nranks

    def worker_index(self):
        return self.rank

    def get_trainer_endpoints(self):
        return list(self.endpoints)

    def place(self):
        import paddle

        return paddle.CPUPlace() if self.device is None else paddle.CUDAPlace(self.device)

    # the workers' collectives, on the host through gloo
    def all_reduce_worker(self, input, output, mode: str = "sum") -> None:
        import paddle

        check_reduce_mode(mode)
        value = np.ascontiguousarray(input)
        if self.nranks > 1:
            scope = paddle.static.Scope()
            write_vars(scope, {"value": value})
            program = reduce_program({"value": (value.shape, value.dtype)}, f"c_allreduce_{mode}")
            with heartbeat.phase("in the workers' all-reduce", waiting=True):
                paddle.static.Executor(paddle.CPUPlace()).run(program, scope=scope)
            value = read_vars(scope, ["value"])["value"]
        np.copyto(np.asarray(output), value.reshape(np.shape(output)))

    def all_gather(self, value) -> list:
        slots = np.zeros(self.nranks, np.float64)
        slots[self.rank] = value
        total = np.empty_like(slots)
        self.all_reduce_worker(slots, total, "sum")
        return [float(v) for v in total]

    def barrier_worker(self) -> None:
        if self.gloo is not None:
            with heartbeat.phase("at the workers' barrier", waiting=True):
                self.gloo.barrier()

    def chain_sum(self, values: np.ndarray) -> np.ndarray:
        """``values`` summed over the workers in worker order along their chain of kspipe's
        own sockets (made at :meth:`init_worker`, or else at the first call, which every
        worker makes in step)."""
        chain = self._chain()
        with heartbeat.phase("in the workers' sum", waiting=True):
            return chain.sum(values)

    def _chain(self):
        if self.chain is None:
            from kspipe.modes.summing import WorkerSum

            self.chain = WorkerSum(self)
        return self.chain

    # distribution
    def refuses(self, needs, cfg) -> str | None:
        return refusal(needs)

    def distributed_optimizer(self, optimizer, strategy=None, feeding: str = "executor"):
        return GradientAllReduce(self, optimizer)

    def embedding(self, ids, size, param_attr, feeding: str = "executor"):
        """A table in every worker, with a dense gradient: the all-reduce sums whole tensors,
        and a sparse gradient (its rows only) is not one."""
        import paddle

        return paddle.static.nn.embedding(ids, size=size, is_sparse=False, param_attr=param_attr)

    def parameter_sync(self, shapes: dict) -> ParameterSync:
        return self._register(ParameterAverage(self, shapes))

    def run_collective(self, program, scope) -> None:
        """Run a program of collective ops on this worker's place (NCCL set up first)."""
        import paddle

        if self.device is not None and not self._nccl_ready:
            self._init_nccl()
        paddle.static.Executor(self.place()).run(program, scope=scope)

    def init_worker(self, scope=None) -> None:
        if self.device is not None and not self._nccl_ready:
            self._init_nccl()  # before the first program with collective ops runs
        if self.device is None and self.nranks > 1:
            self._chain()  # the workers meet now, not inside their first step
        super().init_worker(scope)

    def _init_nccl(self) -> None:
        """Ring 0 over the workers' GPUs, as Paddle's collective tests set it up."""
        import paddle
        from paddle.base import core

        program = paddle.static.Program()
        block = program.global_block()
        nccl_id = block.create_var(
            name="kspipe_nccl_id", persistable=True, type=core.VarDesc.VarType.RAW
        )
        current = self.endpoints[self.rank]
        block.append_op(
            type="c_gen_nccl_id",
            inputs={},
            outputs={"Out": nccl_id},
            attrs={
                "rank": self.rank,
                "endpoint": current,
                "ring_id": 0,
                "other_endpoints": [e for e in self.endpoints if e != current],
            },
        )
        block.append_op(
            type="c_comm_init",
            inputs={"X": nccl_id},
            outputs={},
            attrs={
                "nranks": self.nranks,
                "rank": self.rank,
                "ring_id": 0,
                "endpoints": ",".join(self.endpoints),
            },
        )
        paddle.static.Executor(self.place()).run(program, scope=paddle.static.Scope())
        self._nccl_ready = True


def reduce_program(
    variables: dict,
    op: str = "c_allreduce_sum",
    scale: float | None = None,
    zero_unless: bool | None = None,
    nranks: int | None = None,
):
    """A program that all-reduces persistable ``variables`` ({name: (shape, dtype)}) in place.

    ``scale`` multiplies the result; ``zero_unless=False`` zeroes this worker's values first
    (so a sum over workers is worker 0's values: a broadcast).  Given ``nranks``, a sum is
    one exchange for all the variables (:func:`kspipe.modes.fused.append_sum`); else each
    variable is reduced on its own (``op``, any of the ``c_allreduce_*``).
    """
    import paddle

    program = paddle.static.Program()
    block = program.global_block()
    created = [
        block.create_var(name=name, shape=list(shape), dtype=dtype, persistable=True)
        for name, (shape, dtype) in variables.items()
    ]
    if nranks is not None and op == "c_allreduce_sum":
        append_sum(block, created, nranks, scale=scale, zero=zero_unless is False)
        return program
    for var in created:
        if zero_unless is False:
            append_scale(block, var, 0.0)
        block.append_op(
            type=op,
            inputs={"X": [var]},
            outputs={"Out": [var]},
            attrs={"ring_id": 0, "use_calc_stream": True},
        )
        if scale is not None:
            append_scale(block, var, scale)
    return program


class ParameterAverage(ParameterSync):
    """Worker 0's parameters to all at the start; their mean after each local update."""

    changes_parameters = True

    def __init__(self, role: CollectiveRole, shapes: dict, dtype: str = "float32"):
        self.role = role
        self.variables = {name: (list(shape), dtype) for name, shape in shapes.items()}
        self.scope = None
        alone = not role.reduces
        n = role.nranks
        self.average = None if alone else reduce_program(self.variables, scale=1.0 / n, nranks=n)
        self.broadcast = (
            None if alone else reduce_program(self.variables, zero_unless=role.rank == 0, nranks=n)
        )

    def connect(self, scope) -> None:
        self.scope = scope
        if self.broadcast is not None:
            self.role.run_collective(self.broadcast, scope)

    def step(self, scope=None, values: dict | None = None) -> None:
        """Average the parameters in ``scope``; or, given their ``values`` (from inside a
        running program, whose scope another run must not touch), average those in a
        scope of their own and write the mean back."""
        if self.average is None:
            return
        scope = scope or self.scope
        if values is None:
            self.role.run_collective(self.average, scope)
            return
        import paddle

        scratch = paddle.static.Scope()
        write_vars(scratch, values)
        self.role.run_collective(self.average, scratch)
        write_vars(scope, read_vars(scratch, list(values)))

    def finish(self, scope) -> None:
        self.role.barrier_worker()


class GradientAllReduce:
    """An optimiser whose gradients are all-reduced (mean over workers) in the program."""

    def __init__(self, role: CollectiveRole, optimizer):
        self._role, self._inner = role, optimizer

    def backward(
        self, loss, startup_program=None, parameter_list=None, no_grad_set=None, callbacks=None
    ):
        return self._inner.backward(loss, startup_program, parameter_list, no_grad_set, callbacks)

    def apply_gradients(self, params_grads):
        role = self._role
        if role.reduces:
            block = params_grads[0][1].block
            with block.program._backward_role_guard():  # a for_test clone drops them
                grads = [grad for _, grad in params_grads]
                append_sum(
                    block,
                    grads,
                    role.nranks,
                    scale=1.0 / role.nranks,
                    chain=role.chain_sum if role.device is None else None,
                )
        role.parameter_sync({p.name: p.shape for p, _ in params_grads})  # same start
        return self._inner.apply_gradients(params_grads)

    def minimize(self, loss, startup_program=None, parameter_list=None, no_grad_set=None):
        params_grads = self.backward(loss, startup_program, parameter_list, no_grad_set)
        return self.apply_gradients(params_grads), params_grads


class CollectiveJob(ClusterJob):
    """Starts this host's workers of a collective job and watches them."""

    mode = "collective"

    def __init__(self, cfg, devices: list[int], launcher):
        if devices and isinstance(cfg.workers, int) and cfg.workers != len(devices):
            raise ConfigError(
                f"workers={cfg.workers} but devices names {len(devices)} GPU(s): "
                f"a collective job runs one worker per GPU"
            )
        launcher.check(cfg, len(devices) if devices else process_count(cfg.workers, "workers"))
        super().__init__(cfg, job_hosts("collective", cfg), launcher)
        self.devices = devices

    def refuses(self, needs, cfg) -> str | None:
        return refusal(needs)

    def launch(self, reporter) -> dict:
        cfg = self.cfg
        workers = len(self.devices) if self.devices else cfg.workers
        plan = self.launcher.plan(
            "collective", cfg, workers, threads=cfg.cluster.threads, devices=self.devices
        )
        where = f"GPUs {self.devices}" if self.devices else "CPU, gloo"
        resized = resize_line(cfg)
        if resized:
            reporter.say(resized)
        return self.launcher.run(
            cfg, reporter, plan, f"{len(plan)} collective worker(s) ({where})", hosts=self.hosts
        )
