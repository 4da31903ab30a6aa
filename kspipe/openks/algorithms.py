"""The OpenKS role makers and distributed algorithms, over the modes' roles."""

from __future__ import annotations

import os

from kspipe.modes.role import Role
from kspipe.openks.optimizers import (AsyncStrategy, CollectiveStrategy,
                                      GeneralDistributedOptimizer,
                                      HeterogeneousDistributedOptimizer)


class RoleMakerBase(Role):
    """The seed's base role maker: a one-process job, as :class:`kspipe.modes.role.Role`."""


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


_ROLE_METHODS = {n for n in dir(Role) if not n.startswith("_")} - {"is_launcher", "mode"}


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
        self.role.barrier_worker()

    def init_worker(self) -> None:
        """Meet the other processes; the global scope then holds the shared parameters."""
        self._mode_role().init_worker()

    def stop_worker(self) -> None:
        """Wait for every worker (the global scope then holds the final model), leave."""
        role = self._mode_role()
        role.finish_training()
        role.stop_worker()

    def save_inference_model(self, executor, dirname, feeded_var_names, target_vars,
                             main_program=None, export_for_deployment=True):
        import paddle

        self._mode_role().refresh_parameters()
        program = main_program or paddle.static.default_main_program()
        names = [feeded_var_names] if isinstance(feeded_var_names, str) else feeded_var_names
        feeds = [program.global_block().var(n) if isinstance(n, str) else n for n in names]
        targets = target_vars if isinstance(target_vars, (list, tuple)) else [target_vars]
        os.makedirs(dirname, exist_ok=True)
        paddle.static.save_inference_model(os.path.join(dirname, "model"), feeds, list(targets),
                                           executor, program=program)

    def save_persistables(self, executor, dirname, main_program=None):
        import paddle

        self._mode_role().refresh_parameters()
        os.makedirs(dirname, exist_ok=True)
        paddle.static.save(main_program or paddle.static.default_main_program(),
                           os.path.join(dirname, "persistables"))


class CPUDistributedAlgorithm(BaseDistributedAlgorithm):
    """Parameter servers (the seed's transpiler path), on fleet's the_one_ps."""

    def distributed_optimizer(self, optimizer, strategy=None) -> GeneralDistributedOptimizer:
        self._optimizer = GeneralDistributedOptimizer(optimizer, strategy or AsyncStrategy(),
                                                      algorithm=self)
        return self._optimizer

    def init_server(self, model_dir: str | None = None) -> None:
        import paddle.distributed.fleet as fleet

        if self._optimizer is None or self._optimizer._distributed is None:
            raise RuntimeError("call distributed_optimizer(...).minimize(loss) first, "
                               "in a process the launcher started as a server")
        fleet.init_server(model_dir) if model_dir else fleet.init_server()

    def run_server(self) -> None:
        import paddle.distributed.fleet as fleet

        fleet.run_server()


class GPUDistributedAlgorithm(BaseDistributedAlgorithm):
    """Collective data parallelism (the seed's NCCL2 path); through gloo on a CPU build."""

    collective = True

    def distributed_optimizer(self, optimizer, strategy=None) -> HeterogeneousDistributedOptimizer:
        self._optimizer = HeterogeneousDistributedOptimizer(
            optimizer, strategy or CollectiveStrategy(), algorithm=self)
        return self._optimizer
