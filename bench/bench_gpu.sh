#!/usr/bin/env bash
# The GPU check of mode=collective (NCCL ring, reductions on the GPUs), in one command:
#
#   bash bench/bench_gpu.sh [meta_iters]      # on a machine with NVIDIA GPUs and a driver
#
# It installs paddlepaddle-gpu==2.6.2 (built for CUDA 11.8 / cuDNN 8.6, which it does not
# bundle) with the CUDA 11 runtime from pip's nvidia-*-cu11 packages into a virtual
# environment of its own (.venv-gpu), checks that Paddle sees the GPUs, then runs the
# omniglot_5way experiment with one worker per GPU and locally on GPU 0, and prints
# tasks/s and test accuracy of both.  Everything it writes goes under bench/gpu-runs/.
set -euo pipefail
cd "$(dirname "$0")/.."
ITERS="${1:-300}"
VENV=.venv-gpu
OUT=bench/gpu-runs
mkdir -p "$OUT"
if [ ! -x "$VENV/bin/python" ]; then
  python -m venv "$VENV"
  "$VENV/bin/pip" install -q -e . "paddlepaddle-gpu==2.6.2" \
    "nvidia-cuda-runtime-cu11" "nvidia-cublas-cu11" "nvidia-cudnn-cu11<9" \
    "nvidia-cufft-cu11" "nvidia-curand-cu11" "nvidia-cusolver-cu11" "nvidia-cusparse-cu11" \
    "nvidia-nccl-cu11"
  "$VENV/bin/pip" uninstall -q -y paddlepaddle || true
fi
NV=$("$VENV/bin/python" -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))")/nvidia
export LD_LIBRARY_PATH="$(ls -d "$NV"/*/lib | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$VENV/bin/python" -c "import paddle; paddle.utils.run_check(); print('GPUs:', paddle.device.cuda.device_count())"
GPUS=$("$VENV/bin/python" -c "import paddle; print(','.join(map(str, range(paddle.device.cuda.device_count()))))")
COMMON=(+experiment=omniglot_5way "train.meta_iters=$ITERS" eval.interval=0 eval.tasks=100
        "tracking.uri=sqlite:///$PWD/$OUT/mlflow.db")
cd "$OUT"
echo "== collective, one worker per GPU ($GPUS)"
"../../$VENV/bin/kspipe" "${COMMON[@]}" mode=collective "devices=[$GPUS]" "run_dir=$PWD/collective" | tail -1
echo "== collective, a ring of one (GPU 0)"
"../../$VENV/bin/kspipe" "${COMMON[@]}" mode=collective devices=[0] "run_dir=$PWD/one-gpu" | tail -1
echo "== local, CPU"
"../../$VENV/bin/kspipe" "${COMMON[@]}" mode=local "run_dir=$PWD/cpu" | tail -1
