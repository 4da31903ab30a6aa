"""The OpenKS distributed layer's Python API, over kspipe's modes.

Scripts written against the seed's classes run unchanged, locally, on a loopback
parameter-server cluster (``kspipe-launch --mode cpu ...``) and collectively
(``--mode gpu``, through gloo on a CPU build)::

    algorithm = KSDistributedFactory.instantiation(flag=0)  # 0: parameter servers, 1: collective
    algorithm.init(PaddleCloudRoleMaker())
    optimizer = algorithm.distributed_optimizer(paddle.optimizer.SGD(0.01), strategy)
    optimizer.minimize(loss)
    if algorithm.is_server():
        algorithm.init_server(); algorithm.run_server()
    else:
        algorithm.init_worker(); ...exe.run(...)...; algorithm.stop_worker()

The roles are the modes' own (:mod:`kspipe.modes.pserver`, :mod:`kspipe.modes.collective`),
so a script trains exactly as ``kspipe mode=pserver`` / ``mode=collective`` do.
Differences from the seed, where its behaviour was broken: ``split_files`` gives whole
files in contiguous blocks (the seed divided with ``/`` and sliced with floats); a
script's optimiser runs on the worker and what is exchanged with the servers is the
change it made to the parameters.
"""

from kspipe.fewshot.data import Open_KS_Character, Open_KS_ImageNet, Open_KS_read
from kspipe.openks.algorithms import (
    BaseDistributedAlgorithm,
    CPUDistributedAlgorithm,
    GPUDistributedAlgorithm,
    KSDistributedFactory,
    PaddleCloudRoleMaker,
    RoleMakerBase,
)
from kspipe.openks.feeding import DataFeeder, split_feed
from kspipe.openks.optimizers import (
    AsyncStrategy,
    BaseDistributedOptimizer,
    CollectiveStrategy,
    GeneralDistributedOptimizer,
    GeoStrategy,
    HalfAsyncStrategy,
    HeterogeneousDistributedOptimizer,
    SyncStrategy,
)

__all__ = [
    "RoleMakerBase",
    "PaddleCloudRoleMaker",
    "KSDistributedFactory",
    "BaseDistributedAlgorithm",
    "CPUDistributedAlgorithm",
    "GPUDistributedAlgorithm",
    "BaseDistributedOptimizer",
    "GeneralDistributedOptimizer",
    "HeterogeneousDistributedOptimizer",
    "SyncStrategy",
    "AsyncStrategy",
    "HalfAsyncStrategy",
    "GeoStrategy",
    "CollectiveStrategy",
    "Open_KS_ImageNet",
    "Open_KS_Character",
    "Open_KS_read",
    "DataFeeder",
    "split_feed",
]
