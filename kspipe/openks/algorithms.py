"""The OpenKS role makers and distributed algorithms, over the modes' roles.

Incremental training on parameter servers: a script saves with ``save_persistables(exe,
dir)``; the servers of a later job call ``init_server(dir)``.  The servers' tables get
their first values from worker 0 at ``init_worker`` (kspipe's exchange,
:mod:`kspipe.modes.ps.exchange`), so server 0 reads the saved model and hands it to every
worker (:func:`hand_over`, over the gloo world the servers and workers share), and the
workers start from it, whatever the strategy: worker 0's values, now the saved ones,
become the servers'.  ``kspipe-launch`` sets the environment this needs
(:data:`HAND_OVER_ENV`).
"""

from __future__ import annotations

import os

import numpy as np

from kspipe.checkpoint.incremental import PERSISTABLES  # save_persistables' files: persistables.pd*
from kspipe.errors import ConfigError
from kspipe.modes.role import Role, write_vars
from kspipe.openks.optimizers import (
    AsyncStrategy,
    CollectiveStrategy,
    GeneralDistributedOptimizer,
    HeterogeneousDistributedOptimizer,
)


class RoleMakerBase(Role):
    """The seed's base role maker: a one-process job, as :class:`kspipe.modes.role.Role`,
    with the seed's own additions, which no kspipe workload uses."""

    def to_string(self) -> str:
        kind = "server" if self.is_server() else "worker"
        index = self.server_index() if self.is_server() else self.worker_index()
        return (
            f"role={kind} index={index} worker_num={self.worker_num()} "
            f"trainer_endpoints={self.get_trainer_endpoints()} "
            f"pserver_endpoints={self.get_pserver_endpoints()}"
        )

    def barrier_all(self) -> None:
        """Wait for every process of the job that can wait: the workers (a server sits in
        ``run_server`` until the job ends)."""
        self.barrier_worker()


class PaddleCloudRoleMaker(RoleMakerBase):
    """The role read from the environment the launcher (or a scheduler) set."""

    def __init__(self, is_collective: bool = False):
        super().__init__()
        self.is_collective = is_collective
        self._role: Role | None = None

    def generate_role(self) -> None:
        if self._role is not None:
            return
        if not self.is_collective and os.environ.get("TRAINING_ROLE"):
            from kspipe.modes.pserver import PserverRole

            self._role = PserverRole()
        elif self.is_collective and os.environ.get("PADDLE_TRAINER_ENDPOINTS"):
            from kspipe.modes.collective import CollectiveRole

            self._role = CollectiveRole()
        else:
            self._role = Role()

    @property
    def role(self) -> Role:
        self.generate_role()
        return self._role

    def __getattribute__(self, name):
        if name in _ROLE_METHODS:
            return getattr(object.__getattribute__(self, "role"), name)
        return object.__getattribute__(self, name)


#: What a :class:`PaddleCloudRoleMaker` asks of the mode's role it made; the seed's own
#: additions (:class:`RoleMakerBase`) it answers itself, from those.
_ROLE_METHODS = {n for n in dir(Role) if not n.startswith("_")} - {"is_cluster_job", "mode"}


class KSDistributedFactory:
    @staticmethod
    def instantiation(flag: int) -> "BaseDistributedAlgorithm":
        """0: the parameter-server CPU path; 1: the collective (GPU, or CPU through gloo) path."""
        if flag == 0:
            return CPUDistributedAlgorithm()
        if flag == 1:
            return GPUDistributedAlgorithm()
        raise ValueError(f"KSDistributedFactory.instantiation: flag must be 0 or 1, not {flag!r}")


class BaseDistributedAlgorithm:
    """What every distributed algorithm offers: its role and the workers' collectives."""

    collective = False

    def __init__(self, mode=None):
        self.mode = mode
        self._role_maker: PaddleCloudRoleMaker | None = None
        self._optimizer = None

    def init(self, role_maker: RoleMakerBase | None = None) -> None:
        role_maker = role_maker or PaddleCloudRoleMaker(is_collective=self.collective)
        if isinstance(role_maker, PaddleCloudRoleMaker):
            role_maker.is_collective = self.collective
            role_maker.generate_role()
        self._role_maker = role_maker

    @property
    def role(self):
        if self._role_maker is None:
            self.init()
        return self._role_maker

    def _mode_role(self) -> Role:
        return getattr(self.role, "role", self.role)

    def is_first_worker(self) -> bool:
        return self.role.is_first_worker()

    def _is_worker(self) -> bool:
        return self.role.is_worker()

    def is_worker(self) -> bool:
        return self.role.is_worker()

    def is_server(self) -> bool:
        return self.role.is_server()

    def worker_num(self) -> int:
        return self.role.worker_num()

    def worker_index(self) -> int:
        return self.role.worker_index()

    def worker_endpoints(self, to_string: bool = False):
        endpoints = self.role.get_trainer_endpoints()
        return ",".join(endpoints) if to_string else endpoints

    def split_files(self, files: list) -> list:
        return self.role.split_files(files)

    def all_reduce_worker(self, input, output) -> None:
        self.role.all_reduce_worker(input, output, "sum")

    def barrier_workers(self) -> None:
        """Wait for every worker, each then holding the job's one model (without the
        settling, an async worker holds its own last pull, a geo or local_sgd one its
        own steps since the last exchange)."""
        if self._optimizer is not None:
            self._optimizer.settle_parameters()
        self.role.barrier_worker()

    def init_worker(self) -> None:
        """Meet the other processes; the global scope then holds the shared parameters."""
        self._mode_role().init_worker()

    def stop_worker(self) -> None:
        """Wait for every worker (the global scope then holds the final model), leave."""
        role = self._mode_role()
        role.finish_training()
        role.stop_worker()

    def _refresh_parameters(self) -> None:
        """Before a save mid-training: the global scope takes the job's current parameters,
        so what this worker saves is the job's model (its optimiser's exchange says which)."""
        import paddle

        if self._optimizer is not None:
            self._optimizer.refresh_parameters(paddle.static.global_scope())

    def save_inference_model(
        self,
        executor,
        dirname,
        feeded_var_names,
        target_vars,
        main_program=None,
        export_for_deployment=True,
    ):
        import paddle

        self._refresh_parameters()
        program = main_program or paddle.static.default_main_program()
        names = [feeded_var_names] if isinstance(feeded_var_names, str) else feeded_var_names
        feeds = [program.global_block().var(n) if isinstance(n, str) else n for n in names]
        targets = target_vars if isinstance(target_vars, (list, tuple)) else [target_vars]
        os.makedirs(dirname, exist_ok=True)
        paddle.static.save_inference_model(
            os.path.join(dirname, "model"), feeds, list(targets), executor, program=program
        )

    def save_persistables(self, executor, dirname, main_program=None):
        import paddle

        self._refresh_parameters()
        os.makedirs(dirname, exist_ok=True)
        paddle.static.save(
            main_program or paddle.static.default_main_program(),
            os.path.join(dirname, PERSISTABLES),
        )


class CPUDistributedAlgorithm(BaseDistributedAlgorithm):
    """Parameter servers (the seed's transpiler path), on fleet's the_one_ps."""

    def distributed_optimizer(self, optimizer, strategy=None) -> GeneralDistributedOptimizer:
        self._optimizer = GeneralDistributedOptimizer(
            optimizer, strategy or AsyncStrategy(), algorithm=self
        )
        return self._optimizer

    def init_server(self, model_dir: str | None = None) -> None:
        """Start this server's tables.  ``model_dir``: a folder ``save_persistables`` wrote
        (or a kspipe run or checkpoint: the same format); the job starts from the model
        saved there (server 0 reads it, checked against the
        script's program, and hands it to the workers at their ``init_worker``)."""
        import paddle.distributed.fleet as fleet

        from kspipe.checkpoint import read_state
        from kspipe.checkpoint.incremental import state_prefix

        if self._optimizer is None or self._optimizer._distributed is None:
            raise RuntimeError(
                "call distributed_optimizer(...).minimize(loss) first, "
                "in a process the launcher started as a server"
            )
        if model_dir and not hands_over():
            needs = " ".join(f"{key}={value}" for key, value in HAND_OVER_ENV.items())
            raise ConfigError(
                f"init_server(model_dir) hands the saved model to the workers, "
                f"which needs {needs} in every process (kspipe-launch --mode "
                f"cpu sets them)"
            )
        program = self._optimizer.program
        state = None
        if model_dir and self.role.server_index() == 0:
            key = f"init_server({model_dir!r})"
            state = read_state(program, state_prefix(model_dir, key), key)
        fleet.init_server()
        if hands_over():
            hand_over(program, state)

    def init_worker(self) -> None:
        """Meet the other processes: take the model the servers were started from, if any
        (``init_server(model_dir)``); then worker 0's parameters become the servers'."""
        role = self._mode_role()
        if role.mode == "pserver" and hands_over():
            import paddle

            program = getattr(self._optimizer, "program", None)
            state = hand_over(program or paddle.static.default_main_program())
            if state is not None:
                write_vars(paddle.static.global_scope(), state)
            wait_for_servers(role.get_pserver_endpoints())
        super().init_worker()

    def run_server(self) -> None:
        import paddle.distributed.fleet as fleet

        from kspipe.process import stopping

        stopping.skip_destructors_at_exit()  # a server that gives up ends, not hangs
        fleet.run_server()


class GPUDistributedAlgorithm(BaseDistributedAlgorithm):
    """Collective data parallelism (the seed's NCCL2 path); through gloo on a CPU build."""

    collective = True

    def distributed_optimizer(self, optimizer, strategy=None) -> HeterogeneousDistributedOptimizer:
        self._optimizer = HeterogeneousDistributedOptimizer(
            optimizer, strategy or CollectiveStrategy(), algorithm=self
        )
        return self._optimizer


# --- a model for the servers, handed to the workers ------------------------------------

#: What a parameter-server job's processes need for :func:`hand_over` (kspipe-launch sets
#: it): fleet's gloo among the servers and workers together, not the workers alone; and
#: no waiting for the servers while building the programs, as the servers wait for the
#: workers in ``init_server`` (the workers wait for them in ``init_worker`` instead).
HAND_OVER_ENV = {"PADDLE_WITH_GLOO": "2", "FLAGS_LAUNCH_BARRIER": "0"}


def hands_over() -> bool:
    """Whether this job's servers hand their model to the workers (:data:`HAND_OVER_ENV`)."""
    return all(os.environ.get(k) == v for k, v in HAND_OVER_ENV.items())


def hand_over(program, state: dict | None = None) -> dict | None:
    """The model the job's servers start from, handed from server 0 to every process.

    Every server (in ``init_server``, before it serves) and every worker (in
    ``init_worker``) of the job calls it once: server 0 gives ``state`` (every persistable
    of ``program``, as :func:`kspipe.checkpoint.read_state` read it) or None, and all get
    it back (None: the servers were given no model).  Two sums over the gloo world of all
    the processes: whether there is a model, then its values (as float64, which carries
    float32 and integers exactly).
    """
    import paddle.distributed.fleet as fleet

    def all_reduce(values: np.ndarray) -> np.ndarray:
        return np.asarray(fleet.util.all_reduce(values, mode="sum", comm_world="all"))

    if not all_reduce(np.array([0.0 if state is None else 1.0]))[0]:
        return None
    variables = persistables(program)
    if state is not None:
        flat = np.concatenate([np.ravel(state[var.name]).astype(np.float64) for var in variables])
    else:
        flat = np.zeros(sum(int(np.prod(var.shape)) for var in variables))
    flat, handed = all_reduce(flat), {}
    for var in variables:
        size = int(np.prod(var.shape))
        handed[var.name] = flat[:size].reshape(var.shape).astype(numpy_dtype(var.dtype))
        flat = flat[size:]
    return handed


def persistables(program) -> list:
    """The variables ``paddle.static.save`` writes of ``program``, in one order everywhere."""
    from paddle.framework.io_utils import is_belong_to_optimizer, is_parameter

    chosen = [v for v in program.list_vars() if is_parameter(v) or is_belong_to_optimizer(v)]
    return sorted(chosen, key=lambda var: var.name)


def numpy_dtype(dtype) -> str:
    """The numpy name of a Paddle variable's dtype."""
    from paddle.base.data_feeder import convert_dtype

    return convert_dtype(dtype)


def wait_for_servers(endpoints, timeout_s: float = 600.0) -> None:
    """Return once every server accepts connections (fleet's launch barrier, without its
    3-second naps)."""
    from kspipe.cluster.endpoints import wait_for_listener

    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        wait_for_listener(host, int(port), timeout_s, f"server {endpoint}")
