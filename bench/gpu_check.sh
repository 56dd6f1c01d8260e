#!/usr/bin/env bash
# GPU check (issues 3 and 12): on a CUDA machine, the GPU-only tests (the Triton decode kernel
# compiled for the device, greedy tokens with CUDA graphs equal to eager), then the engine
# throughput benchmark in bf16 with TP 1 (with Triton decode attention and CUDA graphs, and
# without either: the eager baseline), TP 3 where three GPUs exist (SmolLM2's 9 heads split 1,
# 3 or 9 ways) and PP 2 where two do, printing output tokens/s and the KV-cache size. Run from
# the repository root after `make setup-test` (with a CUDA build of torch:
# TORCH_SPEC=torch make setup-test).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
num_gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$num_gpus" -lt 1 ]; then
  echo "gpu_check: no CUDA device visible" >&2
  exit 1
fi
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(0), "x", torch.cuda.device_count())'
echo "== GPU tests"
"$PY" -m pytest -q -m gpu tests/engine/test_paged_attention.py tests/engine/test_cuda_graphs.py
bench() {
  PYTHONUNBUFFERED=1 "$PY" -m bench.engine_throughput --skip-transformers --dtype bfloat16 \
    --tensor-parallel-size "$1" --pipeline-parallel-size "$2" 2>&1 | grep -v '^\r' | tail -6
}
echo "== bf16, TP 1, eager (MERIDIAN_TRITON_KERNELS=0 MERIDIAN_CUDA_GRAPHS=0)"
MERIDIAN_TRITON_KERNELS=0 MERIDIAN_CUDA_GRAPHS=0 bench 1 1
for layout in "1 1" "3 1" "1 2"; do
  read -r tp pp <<<"$layout"
  if [ $((tp * pp)) -le "$num_gpus" ]; then
    echo "== bf16, tensor_parallel_size=$tp, pipeline_parallel_size=$pp"
    bench "$tp" "$pp"
  fi
done
