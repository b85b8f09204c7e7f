#!/usr/bin/env bash
# The checks that need a CUDA device, run on a lent GPU machine (never in CI, which has none):
# the tests that take device tensors (CUDA round trips, mapping, pinned staging, CUDA RNG in
# resumes, layouts kept across puts, the saver process's page-locked shared staging) and
# benches/bench_cuda.py (a model's state; 10,000 small tensors; each through threads and
# through the saver process). The machine has torch; the store's own compiled dependencies travel as cp312
# wheels in .whl/ (see docs/TESTING.md). Output under $1.
set -uo pipefail
OUTDIR=${1:-/tmp/gpu-check}; mkdir -p "$OUTDIR"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUTDIR/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' | tee -a "$OUTDIR/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -m "not slow" -o addopts="-ra" \
  tests/store/test_roundtrip.py tests/read/test_partial_checkout.py tests/store/test_async.py tests/train/test_async_defaults.py \
  tests/train/test_checkpoint_manager.py tests/train/test_manager_state.py tests/train/test_train_resume.py tests/train/test_lightning.py \
  tests/write/test_plan_cache.py tests/write/test_saver.py -k "not object_store" \
  2>&1 | tee "$OUTDIR/tests.txt"
for saver in thread process; do
  timeout 100 python3 benches/bench_cuda.py --scale "${BENCH_GB:-2}" --repeats 3 --saver $saver --dir /tmp 2>&1 \
    | tee -a "$OUTDIR/bench_cuda.txt"
done
# thousands of small device tensors (an FSDP rank's count): the stall of a layout kept across puts
for saver in thread process; do
  timeout 60 python3 benches/bench_cuda.py --many 10000 --repeats 3 --saver $saver --dir /tmp 2>&1 \
    | tee -a "$OUTDIR/bench_cuda_many.txt"
done
