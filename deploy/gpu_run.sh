#!/usr/bin/env bash
# On a lent GPU machine: served throughput on a 0.5B-class model, then the gpu tests, everything
# written under $OUT. Packed here first by `python deploy/gpu_kit.py` (that machine reaches no
# package registry and can download no model), then, with the device tool:
#
#     run(command="bash deploy/gpu_run.sh", carry=[".gpukit"], timeout_s=600)
#     run(command="bash deploy/gpu_run.sh bench", ...)   # one step: bench | tests
#
# bench (first: the number a lease is for): benchmarks/serving.py, in-process against
# `tandem serve` colocated on the one GPU, at CONCURRENCY streams (default 16 and 64) over ROUNDS
# interleaved rounds (default 1), on "gpu-0.5b": Qwen2.5-0.5B's shape with random weights and
# SmolLM2's tokenizer, built there from .gpukit/source;
# tests: every test marked gpu (the Triton kernels against their torch references, the engine
# against transformers, sampling on CUDA logits).
# Each step has a deadline (BENCH_S, TESTS_S) that leaves the call's 600 s room for the other.
set -uo pipefail
STEPS=${1:-all}
OUT=${OUT:-/tmp/gpu-out}
KIT=.gpukit
mkdir -p "$OUT"
if [ ! -d "$KIT/wheels" ]; then
    echo "gpu_run: no $KIT/wheels: run python deploy/gpu_kit.py here and carry .gpukit" >&2
    exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$KIT"/wheels/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.csv" 2>&1
python3 -c "import sys, torch, triton, ray, fastapi, transformers
print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__,
      'ray', ray.__version__, 'fastapi', fastapi.__version__,
      'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" \
    2>&1 | tee "$OUT/versions.txt"
status=0
if [ "$STEPS" = all ] || [ "$STEPS" = bench ]; then
    timeout "${BENCH_S:-300}" python3 benchmarks/serving.py --models gpu-0.5b \
        --source "$KIT/source" --device cuda --concurrency ${CONCURRENCY:-16 64} \
        --rounds "${ROUNDS:-1}" --targets inprocess colocated --json "$OUT/serving-gpu.json" \
        2>&1 | tee "$OUT/serving.log"
    status=$((status | PIPESTATUS[0]))
fi
if [ "$STEPS" = all ] || [ "$STEPS" = tests ]; then
    mapfile -t files < <(grep -rl "mark.gpu" tests)
    timeout "${TESTS_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider "${files[@]}" \
        2>&1 | tee "$OUT/gpu-tests.log"
    status=$((status | PIPESTATUS[0]))
fi
exit "$status"
