"""The seed's OpenKS API as kspipe keeps it: every documented name with its signature, the
one-process role and its file split, half-async refused with its reason, and the GPU path's
collective ops written into the program (on a CPU build)."""

import inspect
import subprocess
import sys

import numpy as np
import pytest

from kspipe import openks

SIGNATURES = {
    "RoleMakerBase": [
        "is_worker",
        "is_server",
        "is_first_worker",
        "worker_num",
        "worker_index",
        "server_index",
        "get_trainer_endpoints",
        "to_string",
        "all_gather",
        "all_reduce_worker",
        "barrier_worker",
        "barrier_all",
    ],
    "PaddleCloudRoleMaker": ["generate_role"],
    "BaseDistributedAlgorithm": [
        "is_first_worker",
        "is_worker",
        "worker_num",
        "worker_endpoints",
        "is_server",
        "split_files",
        "init",
        "all_reduce_worker",
        "barrier_workers",
    ],
    "CPUDistributedAlgorithm": [
        "init_worker",
        "init_server",
        "run_server",
        "stop_worker",
        "distributed_optimizer",
        "save_inference_model",
        "save_persistables",
    ],
    "GPUDistributedAlgorithm": [
        "distributed_optimizer",
        "save_inference_model",
        "save_persistables",
    ],
    "GeneralDistributedOptimizer": ["backward", "apply_gradients", "minimize"],
    "HeterogeneousDistributedOptimizer": ["backward", "apply_gradients", "minimize"],
    "Open_KS_read": ["read_dataset"],
    "Open_KS_Character": ["sample"],
    "Open_KS_ImageNet": ["sample"],
}

PARAMETERS = {
    ("RoleMakerBase", "all_reduce_worker"): ["input", "output", "mode"],
    ("PaddleCloudRoleMaker", "__init__"): ["is_collective"],
    ("BaseDistributedAlgorithm", "worker_endpoints"): ["to_string"],
    ("BaseDistributedAlgorithm", "init"): ["role_maker"],
    ("BaseDistributedAlgorithm", "all_reduce_worker"): ["input", "output"],
    ("CPUDistributedAlgorithm", "init_server"): ["model_dir"],
    ("CPUDistributedAlgorithm", "distributed_optimizer"): ["optimizer", "strategy"],
    ("CPUDistributedAlgorithm", "save_inference_model"): [
        "executor",
        "dirname",
        "feeded_var_names",
        "target_vars",
        "main_program",
        "export_for_deployment",
    ],
    ("CPUDistributedAlgorithm", "save_persistables"): ["executor", "dirname", "main_program"],
    ("BaseDistributedOptimizer", "__init__"): ["optimizer", "strategy"],
    ("GeneralDistributedOptimizer", "backward"): [
        "loss",
        "startup_program",
        "parameter_list",
        "no_grad_set",
        "callbacks",
    ],
    ("GeneralDistributedOptimizer", "apply_gradients"): ["params_grads"],
    ("GeneralDistributedOptimizer", "minimize"): [
        "loss",
        "startup_program",
        "parameter_list",
        "no_grad_set",
    ],
    ("Open_KS_Character", "sample"): ["num_images"],
    ("Open_KS_read", "read_dataset"): ["data_dir"],
}


def test_every_documented_name_exists_with_its_signature():
    for cls, methods in SIGNATURES.items():
        for method in methods:
            assert callable(getattr(getattr(openks, cls), method)), (cls, method)
    for (cls, method), params in PARAMETERS.items():
        names = list(inspect.signature(getattr(getattr(openks, cls), method)).parameters)[1:]
        assert names[: len(params)] == params, (cls, method, names)
    assert isinstance(openks.KSDistributedFactory.instantiation(0), openks.CPUDistributedAlgorithm)
    assert isinstance(openks.KSDistributedFactory.instantiation(1), openks.GPUDistributedAlgorithm)
    for strategy in (
        openks.SyncStrategy,
        openks.AsyncStrategy,
        openks.HalfAsyncStrategy,
        openks.GeoStrategy,
        openks.CollectiveStrategy,
    ):
        assert strategy().mode


def test_one_process_role_and_split_files():
    algorithm = openks.KSDistributedFactory.instantiation(0)
    role = openks.PaddleCloudRoleMaker()
    algorithm.init(role)
    assert role.to_string() == (
        "role=worker index=0 worker_num=1 trainer_endpoints=[] pserver_endpoints=[]"
    )
    role.barrier_all()  # alone: returns at once
    assert algorithm.is_first_worker() and algorithm.is_worker() and not algorithm.is_server()
    assert algorithm.worker_num() == 1 and algorithm.worker_endpoints(to_string=True) == ""
    assert algorithm.split_files(["a", "b", "c"]) == ["a", "b", "c"]
    out = np.zeros(3)
    algorithm.all_reduce_worker(np.array([1.0, 2.0, 3.0]), out)
    assert list(out) == [1, 2, 3]


def test_split_files_gives_whole_files_in_blocks():
    class Third(openks.RoleMakerBase):
        def worker_num(self):
            return 3

        def worker_index(self):
            return self.index

    shares = []
    for index in range(3):
        role = Third()
        role.index = index
        shares.append(role.split_files([f"part-{i}" for i in range(7)]))
    assert shares == [["part-0", "part-1", "part-2"], ["part-3", "part-4"], ["part-5", "part-6"]]


def test_half_async_is_refused_with_a_reason():
    from kspipe.errors import ConfigError

    with pytest.raises(ConfigError, match="no half-async mode"):
        openks.GeneralDistributedOptimizer(None, openks.HalfAsyncStrategy())
    with pytest.raises(ValueError, match="flag must be 0 or 1"):
        openks.KSDistributedFactory.instantiation(2)


#: A script that builds a small program on the collective (GPU) path with a compile option,
#: and records per worker the ops ``minimize`` wrote into it.
COLLECTIVE_PROGRAM = """
import json, sys
import paddle
from kspipe.openks import CollectiveStrategy, KSDistributedFactory, PaddleCloudRoleMaker

paddle.enable_static()
algorithm = KSDistributedFactory.instantiation(flag=1)
algorithm.init(PaddleCloudRoleMaker(is_collective=True))
main, startup = paddle.static.Program(), paddle.static.Program()
with paddle.static.program_guard(main, startup):
    x = paddle.static.data("x", [None, 4], "float32")
    loss = paddle.mean(paddle.static.nn.fc(x, 1))
    optimizer = algorithm.distributed_optimizer(
        paddle.optimizer.SGD(0.1), CollectiveStrategy(build_strategy={"enable_inplace": False}))
    optimizer.minimize(loss)
ops = main.global_block().ops
fusing = [op for op in ops if op.type == "coalesce_tensor"]
buffers = [op.output("FusedOutput")[0] for op in fusing]
record = {
    "ops": [op.type for op in ops],
    "fused": [name for op in fusing for name in op.input("Input")],
    "exchanged": [op.input("X")[0] for op in ops
                  if op.type in ("c_allreduce_sum", "c_allgather", "py_func")],
    "buffers": buffers,
    "gradients": [p.name + "@GRAD" for p in main.all_parameters()],
    "scales": [op.attr("scale") for op in ops
               if op.type == "scale" and op.output("Out")[0] in buffers],
    "waits": [op.input("X")[0] for op in ops if op.type == "depend"],
    "test_ops": [op.type for op in main.clone(for_test=True).global_block().ops],
    "compiled": isinstance(optimizer.compiled_program, paddle.static.CompiledProgram),
}
with open(f"{sys.argv[1]}/worker-{algorithm.worker_index()}.json", "w") as f:
    json.dump(record, f)
"""


def test_the_gpu_path_writes_collective_ops_into_the_program(tmp_path):
    """HeterogeneousDistributedOptimizer on a collective job of two workers: the gradients,
    fused into one buffer, are summed over the workers in one exchange and scaled before
    the optimiser reads them (it waits on the buffer for each), a for_test clone drops the
    ops, and ``minimize`` leaves the compiled program for the script to run."""
    import json

    script = tmp_path / "collective_program.py"
    script.write_text(COLLECTIVE_PROGRAM)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kspipe.openks.launch",
            "--mode",
            "gpu",
            "--worker_num",
            "2",
            "--log_dir",
            str(tmp_path / "logs"),
            "--timeout",
            "120",
            str(script),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for index in range(2):
        worker = json.loads((tmp_path / f"worker-{index}.json").read_text())
        ops, gradients = worker["ops"], sorted(worker["gradients"])
        assert sorted(worker["fused"]) == gradients and len(worker["buffers"]) == 1
        assert worker["exchanged"] == worker["buffers"]  # one exchange, of the buffer
        # on a GPU Paddle's collective op; on this CPU build the workers' chain (a py_func)
        exchanges = [
            i for i, t in enumerate(ops) if t in ("c_allreduce_sum", "c_allgather", "py_func")
        ]
        assert len(exchanges) == 1 and exchanges[0] < ops.index("sgd")
        assert worker["scales"] == [0.5]
        assert sorted(worker["waits"]) == gradients
        assert max(i for i, t in enumerate(ops) if t == "depend") < ops.index("sgd")
        assert not {"c_allreduce_sum", "c_allgather"} & set(worker["test_ops"])
        assert worker["compiled"]
