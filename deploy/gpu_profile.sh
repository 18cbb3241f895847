#!/usr/bin/env bash
# deploy/gpu_run.sh's profile step (run there, PYTHONPATH already set): `tandem serve` 1P1D on
# the one GPU (each worker on half of it) under `tandem bench` at CONCURRENCY's first value,
# the serving process and each worker sampled by py-spy for PROFILE_S seconds. Writes into
# OUT_DIR: prof-serve.txt and prof-<pid>.txt per worker (folded stacks by thread, idle
# frames included: a worker whose threads have a `tandem-kv-sender` is the prefill one, with
# `kv-recv-` the decode one); the bench's summary and the server's log go to stdout.
set -uo pipefail
out=$1
seconds=${PROFILE_S:-20}
streams=${CONCURRENCY:-16}
streams=${streams%% *}
port=8300
spy=${PY_SPY:-/tmp/site/bin/py-spy}
device=${DEVICE:-cuda}  # DEVICE=cpu MODEL=... PY_SPY=... try it on a machine without a GPU
placement=()
[ "$device" = cuda ] && placement=(--gpus-per-worker 0.5)
model=${MODEL:-$(python3 -c "from pathlib import Path; from benchmarks.serving import random_model
print(random_model('gpu-0.5b', Path('.gpukit/source')))")} || exit 1
python3 -m cli.main serve --model "$model" --mode disaggregated --prefill-workers 1 \
    --decode-workers 1 "${placement[@]}" --device "$device" --no-prefix-caching \
    --max-num-seqs 64 --log-level warning --port "$port" >/tmp/profile-serve.log 2>&1 &
server=$!
cleanup() {
    kill "${bench:-}" 2>/dev/null
    kill "$server" 2>/dev/null
    sleep 3
    echo "--- server log"
    tail -n 40 /tmp/profile-serve.log
}
trap cleanup EXIT
healthy() {
    python3 -c "import httpx, sys
sys.exit(httpx.get('http://127.0.0.1:$port/health', timeout=2).status_code != 200)" 2>/dev/null
}
for _ in $(seq 120); do
    healthy && break
    kill -0 "$server" 2>/dev/null || exit 1
    sleep 1
done
healthy || { echo "gpu_profile: the server never answered /health"; exit 1; }
bench_args=(--base-url "http://127.0.0.1:$port" --tokenizer "$model" --dataset-name random
    --input-len 100 --output-len 128 --max-concurrency "$streams" --ignore-eos)
python3 -m cli.main bench "${bench_args[@]}" --num-prompts $((2 * streams)) >/dev/null 2>&1
# 40 requests a stream: at the ~20 req/s 1P1D served on one H200 (16 streams) about 30 s,
# longer than the profile
python3 -m cli.main bench "${bench_args[@]}" --num-prompts $((40 * streams)) \
    >/tmp/profile-bench.log 2>&1 &
bench=$!
sleep 3
pids=("$server" $(pgrep -f "ray::WorkerActor"))
names=(serve)
for pid in "${pids[@]:1}"; do names+=("$pid"); done
for i in "${!pids[@]}"; do
    "$spy" record --pid "${pids[$i]}" --duration "$seconds" --rate 200 --idle --threads \
        --format raw --output "$out/prof-${names[$i]}.txt" --nonblocking >/dev/null 2>&1 &
done
wait $(jobs -p | grep -v "^$bench$" | grep -v "^$server$")
wait "$bench"
grep -E "throughput|Median TTFT|Median ITL|Failed" /tmp/profile-bench.log
ls -la "$out"/prof-*.txt
