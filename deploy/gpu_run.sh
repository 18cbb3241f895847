#!/usr/bin/env bash
# On a lent GPU machine: the gpu tests and served throughput on a 0.5B-class model, everything
# written under $OUT. Packed here first by `python deploy/gpu_kit.py` (that machine reaches no
# package registry and can download no model), then, with the device tool:
#
#     run(command="bash deploy/gpu_run.sh", carry=[".gpukit"], timeout_s=600)
#     run(command="bash deploy/gpu_run.sh tests bench eager", ...)   # steps, in this order
#
# bench (the default, with tests after it): benchmarks/serving.py, in-process against
# `tandem serve` on the one GPU (TARGETS, default stepped, in-process, colocated, colocated with
# --stream-interval 4 and 1P1D, every worker on half the GPU: --gpus-per-worker 0.5; at 64
# streams the serving process bounds a GPU, and the interval shows what its per-token path costs
# there), at CONCURRENCY streams (default 16 and 64) over
# ROUNDS interleaved rounds (default 1), on "gpu-0.5b": Qwen2.5-0.5B's shape with random
# weights and SmolLM2's tokenizer, built there from .gpukit/source;
# eager: the same with --enforce-eager (no CUDA graphs), stepped and colocated, one round;
# engine: benchmarks/engine_throughput.py --device cuda (ENGINE_ARGS added): decode step times
# against the bandwidth floor, CUDA graphs against eager, 256 x 1k/256 throughput, on
# `tandem make-model` folders of Llama-3.2-1B and Llama-3.1-8B written under /tmp;
# kernels: benchmarks/kernels.py, each Triton kernel against torch at Llama-3-8B shapes;
# kvtransfer: benchmarks/kv_transfer.py --device cuda (KVT_ARGS added): KV between two processes
# on the one GPU per transport (default ipc) against the device's copy rate, the TTFT
# disaggregation adds at 1k/4k/16k prompt tokens on Llama-3.2-1B (KVT_ARCH), and the mixed
# load's ITL (20% of requests with 4k-token prompts), colocated against 1P1D;
# tests: every test marked gpu in TESTS (default: every file with one; the Triton kernels against their torch references, the engine
# against transformers, CUDA graphs against eager steps, pools sharing the GPU, sampling);
# profile: `tandem serve` 1P1D on the GPU under `tandem bench` (CONCURRENCY's first value), each
# worker process sampled by py-spy for PROFILE_S seconds (raw folded stacks, idle frames too):
# where a disaggregated request's time goes there.
# Each step has a deadline (BENCH_S, EAGER_S, TESTS_S) so that the others keep their time; at
# it the step gets SIGINT, so pytest still prints its failures so far (a SIGTERM lost them once),
# and every failure's traceback is in gpu-failures.log as it happens (a test that ignores SIGINT
# until the SIGKILL 20 s later lost them too).
set -uo pipefail
STEPS=${*:-bench tests}
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

serving() {  # NAME SECONDS ARGS...: one benchmarks/serving.py run, its table in $OUT/NAME.*
    local name=$1 seconds=$2
    shift 2
    timeout -s INT -k 20 "$seconds" python3 benchmarks/serving.py --models gpu-0.5b \
        --source "$KIT/source" --device cuda --concurrency ${CONCURRENCY:-16 64} \
        --gpus-per-worker 0.5 --json "$OUT/$name.json" "$@" 2>&1 |
        grep -v "it/s]" | tee "$OUT/$name.log"
    return "${PIPESTATUS[0]}"
}

status=0
for step in $STEPS; do
    case $step in
    bench)
        # shellcheck disable=SC2086
        serving serving-gpu "${BENCH_S:-300}" --rounds "${ROUNDS:-1}" \
            --targets ${TARGETS:-stepped inprocess colocated colocated-interval4 1p1d}
        status=$((status | $?))
        ;;
    eager)
        serving serving-gpu-eager "${EAGER_S:-120}" --rounds 1 --targets stepped colocated \
            --enforce-eager
        status=$((status | $?))
        ;;
    profile)
        timeout -s INT -k 20 "${PROFILE_S_TOTAL:-150}" bash deploy/gpu_profile.sh "$OUT" \
            2>&1 | tee "$OUT/profile.log"
        status=$((status | PIPESTATUS[0]))
        ;;
    engine)
        # shellcheck disable=SC2086
        timeout -s INT -k 20 "${ENGINE_S:-260}" python3 benchmarks/engine_throughput.py \
            --device cuda --json "$OUT/engine-cuda.json" ${ENGINE_ARGS:-} 2>&1 |
            tee "$OUT/engine-cuda.log"
        status=$((status | PIPESTATUS[0]))
        ;;
    kvtransfer)
        # shellcheck disable=SC2086
        timeout -s INT -k 20 "${KVT_S:-200}" python3 benchmarks/kv_transfer.py --device cuda \
            --arch ${KVT_ARCH:-llama-3.2-1b} --transports ${KVT_TRANSPORTS:-ipc} --repeats 2 \
            --num-short 40 --short-output 512 --num-long 10 --long-len 4096 --long-every 0.1 \
            --json "$OUT/kv-transfer-cuda.json" ${KVT_ARGS:-} 2>&1 | tee "$OUT/kv-transfer-cuda.log"
        status=$((status | PIPESTATUS[0]))
        ;;
    kernels)
        timeout -s INT -k 20 "${KERNELS_S:-120}" python3 benchmarks/kernels.py \
            --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
        status=$((status | PIPESTATUS[0]))
        ;;
    tests)
        if [ -n "${TESTS:-}" ]; then
            read -ra files <<<"$TESTS"
        else
            mapfile -t files < <(grep -rl "mark.gpu" tests)
        fi
        # each failure's traceback lands in gpu-failures.log at once (tests/conftest.py)
        TANDEM_FAILURE_LOG="$OUT/gpu-failures.log" \
            timeout -s INT -k 20 "${TESTS_S:-240}" python3 -m pytest -q -rf -m gpu -p no:cacheprovider \
            "${files[@]}" \
            2>&1 | tee "$OUT/gpu-tests.log"
        status=$((status | PIPESTATUS[0]))
        ;;
    *)
        echo "gpu_run: unknown step $step (bench, eager, engine, kernels, kvtransfer, profile, tests)" >&2
        exit 2
        ;;
    esac
done
exit "$status"
