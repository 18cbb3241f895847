"""Decode steps against the memory-bandwidth floor, on a GPU: what `engine_throughput.py --device
cuda` runs (the CPU works too, at small sizes, to try it out).

    python benchmarks/engine_throughput.py --device cuda [--arch llama-3.2-1b llama-3.1-8b] \
        [--models-dir /tmp/models] [--json results/decode_steps.json]

Per architecture (a `tandem make-model` folder with random weights, written once under
--models-dir), one engine with CUDA graphs:
- **Step time** at each batch size and context: the largest batch of requests is prefilled to
  the context, then requests are aborted down to each smaller batch; each size takes WARM_STEPS
  steps, then the median of TIMED_STEPS timed ones (`LLMEngine.step()`, sampling and the
  tokens' copy to the host included).
- **The floor**: a decode step must read every weight it multiplies by (all but the embedding
  table, of which it reads a row per sequence) and every context token's K and V once; bytes
  over the device's copy bandwidth (a large device-to-device copy, read + write) is the least
  time it can take. "of floor" is floor / step: 100% is the bandwidth limit.
- **Throughput**: REQUESTS requests of INPUT_LEN random prompt ids and OUTPUT_LEN tokens each
  (greedy, EOS ignored), all submitted at once: output tokens per second.
Then the same model with `cuda_graphs=False` at batch 1 and 32 (the smallest context): graphs
against eager launches. Batches whose KV does not fit the pool are skipped and said so.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.engine import LLMEngine  # noqa: E402
from engine.gpu_memory import weight_bytes  # noqa: E402
from engine.kv_cache import bytes_per_block  # noqa: E402
from protocol.messages import TokenUpdate  # noqa: E402
from protocol.sampling import SamplingParams  # noqa: E402

WARM_STEPS = 2
TIMED_STEPS = 10
PROMPT_SEED = 0
LONG_GENERATION = 1 << 20  # the step sweep aborts its requests; they never finish alone
EAGER_BATCHES = (1, 32)
INPUT_LEN, OUTPUT_LEN = 1024, 256  # the throughput run's requests
EAGER_KV_BYTES = 8 << 30  # 32 rows of the smallest context, for an 8B model, with room


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy, read + write, best of five."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_ids(count: int, length: int, vocab: int, seed: int = PROMPT_SEED) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def multiplied_bytes(engine: LLMEngine) -> int:
    """Weight bytes a decode step reads whatever its batch: every matrix it multiplies by. The
    embedding table is read a row per sequence, unless it is also the LM head."""
    cfg = engine.model_config
    dtype = getattr(torch, engine.config.dtype)
    embedding = cfg.vocab_size * cfg.hidden_size * dtype.itemsize
    return weight_bytes(cfg, dtype) - (0 if cfg.tie_word_embeddings else embedding)


def kv_read_bytes(engine: LLMEngine, batch: int, context: int) -> int:
    """K and V bytes a decode step of `batch` rows over `context` tokens reads."""
    dtype = getattr(torch, engine.config.dtype)
    return batch * context * bytes_per_block(engine.model_config, 1, dtype)


def start_decoding(engine: LLMEngine, ids: list[str], context: int, seed: int) -> None:
    """Requests `ids` with random prompts of `context` tokens, prefilled: the next steps are
    all decodes. They generate until aborted."""
    params = SamplingParams(max_tokens=LONG_GENERATION, temperature=0, ignore_eos=True)
    prompts = random_ids(len(ids), context, engine.model_config.vocab_size, seed)
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    while (s := engine.snapshot()).num_waiting or s.queued_prefill_tokens:
        engine.step()


def fits(engine: LLMEngine, batch: int, context: int) -> bool:
    per_seq = -(-(context + WARM_STEPS + TIMED_STEPS + 1) // engine.config.block_size)
    return batch * per_seq <= engine.blocks.num_free_blocks


def step_times(engine: LLMEngine, batches: list[int], context: int) -> dict[int, dict]:
    """Median decode step per batch size (largest first, aborting down), with the mean context
    the timed steps saw."""
    fitting = [b for b in sorted(batches, reverse=True) if fits(engine, b, context)]
    if not fitting:
        return {}
    ids = [f"ctx{context}-{i}" for i in range(fitting[0])]
    start_decoding(engine, ids, context, PROMPT_SEED)
    results, steps_taken = {}, 0
    for batch in fitting:
        for request_id in ids[batch:]:
            engine.abort(request_id)
        ids = ids[:batch]
        for _ in range(WARM_STEPS):
            engine.step()
        times = []
        for _ in range(TIMED_STEPS):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        steps_taken += WARM_STEPS + TIMED_STEPS
        results[batch] = {
            "step_ms": statistics.median(times) * 1e3,
            "context": context + steps_taken - TIMED_STEPS // 2,
        }
    for request_id in ids:
        engine.abort(request_id)
    return results


def throughput(engine: LLMEngine, requests: int, input_len: int, output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    prompts = random_ids(requests, input_len, engine.model_config.vocab_size, seed=1)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"tp-{i}", prompt, params)
    tokens = 0
    while engine.has_unfinished:
        tokens += sum(len(u.token_ids) for u in engine.step() if isinstance(u, TokenUpdate))
    seconds = time.perf_counter() - start
    return {
        "requests": requests, "input_len": input_len, "output_len": output_len,
        "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
    }  # fmt: skip


def sweep_rows(
    engine: LLMEngine, arch: str, graphs: bool, batches: list[int], contexts: list[int], bw: float
) -> list[dict]:
    rows, weights = [], multiplied_bytes(engine)  # (the model built once on the meta device)
    for context in contexts:
        measured = step_times(engine, batches, context)
        for batch in batches:
            if batch not in measured:
                rows.append({"arch": arch, "graphs": graphs, "batch": batch, "context": context,
                             "skipped": "KV pool too small"})  # fmt: skip
                continue
            m = measured[batch]
            kv = kv_read_bytes(engine, batch, m["context"])
            rows.append({
                "arch": arch, "graphs": graphs, "batch": batch, "context": context,
                "mean_context": m["context"], "step_ms": m["step_ms"],
                "weights_floor_ms": weights / bw * 1e3, "floor_ms": (weights + kv) / bw * 1e3,
            })  # fmt: skip
    return rows


def engine_for(folder: Path, args: argparse.Namespace, graphs: bool) -> LLMEngine:
    """The sweep's engine: with graphs, the GPU's --gpu-memory-utilization for its KV pool;
    without (EAGER_BATCHES at the smallest context only), a pool of EAGER_KV_BYTES."""
    from engine.config import EngineConfig

    on_cpu = args.device == "cpu"
    share = args.gpu_memory_utilization if graphs and not on_cpu else None
    kv_bytes = args.cpu_kv_bytes if graphs or on_cpu else EAGER_KV_BYTES
    config = EngineConfig(
        model=folder, dtype=args.dtype, device=args.device, max_num_seqs=max(args.batches),
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
        gpu_memory_utilization=share, kv_cache_memory_bytes=kv_bytes, cuda_graphs=graphs,
        max_model_len=max(args.contexts) + args.input_len + args.output_len + 64,
    )  # fmt: skip
    return LLMEngine(config)


def bench_arch(folder: Path, arch: str, args: argparse.Namespace, bw: float) -> dict:
    """One architecture's rows; a phase that fails is recorded with its error, and the next
    phase still runs (a GPU call is too scarce to lose to one)."""
    result: dict = {"arch": arch, "rows": [], "errors": []}
    started = time.perf_counter()
    try:
        engine = engine_for(folder, args, graphs=True)
        result["load_s"] = time.perf_counter() - started
        result["kv_blocks"] = engine.num_blocks
        result["rows"] += sweep_rows(engine, arch, True, args.batches, args.contexts, bw)
        result["throughput"] = throughput(engine, args.requests, args.input_len, args.output_len)
        engine.close()
    except Exception as err:  # noqa: BLE001 - recorded, and the eager phase still runs
        result["errors"].append(f"graphs: {type(err).__name__}: {err}")
    engine = None
    free_memory()
    try:
        eager = engine_for(folder, args, graphs=False)
        batches = [b for b in EAGER_BATCHES if b <= max(args.batches)]
        result["rows"] += sweep_rows(eager, arch, False, batches, args.contexts[:1], bw)
        eager.close()
    except Exception as err:  # noqa: BLE001
        result["errors"].append(f"eager: {type(err).__name__}: {err}")
    eager = None
    free_memory()
    return result


def profile_arch(folder: Path, arch: str, args: argparse.Namespace, bw: float) -> dict:
    engine = engine_for(folder, args, graphs=True)
    context = args.contexts[0]
    profiles, weights = [], multiplied_bytes(engine)
    for batch in args.batches:
        p = profile_steps(engine, batch, context)
        p["floor_ms"] = (weights + kv_read_bytes(engine, batch, context)) / bw * 1e3
        print_profile(arch, p, p["floor_ms"])
        profiles.append(p)
    engine.close()
    engine = None  # the next architecture needs this one's memory back
    free_memory()
    return {"arch": arch, "profiles": profiles}


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"GPU memory allocated: {torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)


def print_tables(results: list[dict], bw: float) -> None:
    print(f"device copy bandwidth: {bw / 1e9:.0f} GB/s (read + write)")
    print(f"{'arch':<14}{'graphs':>7}{'batch':>6}{'ctx':>6}{'step ms':>9}{'floor ms':>9}"
          f"{'of floor':>9}{'w-floor':>9}{'step/w':>8}")  # fmt: skip
    for result in results:
        for r in result["rows"]:
            head = f"{r['arch']:<14}{'yes' if r['graphs'] else 'no':>7}{r['batch']:>6}"
            head += f"{r['context']:>6}"
            if "skipped" in r:
                print(f"{head}  {r['skipped']}")
                continue
            print(f"{head}{r['step_ms']:>9.2f}{r['floor_ms']:>9.2f}"
                  f"{100 * r['floor_ms'] / r['step_ms']:>8.0f}%{r['weights_floor_ms']:>9.2f}"
                  f"{r['step_ms'] / r['weights_floor_ms']:>7.2f}x")  # fmt: skip
    for result in results:
        for error in result["errors"]:
            print(f"{result['arch']}: FAILED {error}")
        if "throughput" not in result:
            continue
        t = result["throughput"]
        print(f"{result['arch']}: {t['requests']} requests x {t['input_len']} in / "
              f"{t['output_len']} out: {t['tokens_per_s']:.0f} output tok/s "
              f"({t['seconds']:.1f} s, engine load {result['load_s']:.0f} s, "
              f"{result['kv_blocks']} KV blocks)")  # fmt: skip
    for result in results:
        by = {(r["graphs"], r["batch"], r["context"]): r for r in result["rows"]}
        context = min(r["context"] for r in result["rows"])
        for batch in EAGER_BATCHES:
            graph, eager = by.get((True, batch, context)), by.get((False, batch, context))
            if graph and eager and "skipped" not in graph and "skipped" not in eager:
                print(f"{result['arch']} batch {batch} ctx {context}: CUDA graphs "
                      f"{eager['step_ms'] / graph['step_ms']:.2f}x faster than eager")  # fmt: skip


def profile_steps(engine: LLMEngine, batch: int, context: int, steps: int = 20) -> dict:
    """`steps` decode steps of `batch` rows under torch.profiler: the wall time per step beside
    the GPU's kernel time per step (what the device did) and the busiest kernels and host
    calls. Wall minus kernel time is the step's time with the GPU idle."""
    from torch.profiler import ProfilerActivity, profile

    ids = [f"prof-{i}" for i in range(batch)]
    start_decoding(engine, ids, context, seed=2)
    for _ in range(WARM_STEPS + 1):
        engine.step()
    cuda = engine.config.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) / steps
    for request_id in ids:
        engine.abort(request_id)
    events = prof.key_averages()
    kernels = [e for e in events if cuda and e.device_type.name == "CUDA"]
    kernel_s = sum(e.self_device_time_total for e in kernels) / 1e6 / steps
    top_gpu = sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]
    top_cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    return {
        "batch": batch, "context": context, "wall_ms": wall * 1e3, "kernel_ms": kernel_s * 1e3,
        "top_kernels": [(e.key[:70], e.self_device_time_total / 1e3 / steps) for e in top_gpu],
        "top_host": [(e.key[:70], e.self_cpu_time_total / 1e3 / steps) for e in top_cpu],
    }  # fmt: skip


def print_profile(arch: str, p: dict, floor_ms: float) -> None:
    print(f"{arch} batch {p['batch']} ctx {p['context']}: step {p['wall_ms']:.2f} ms wall, "
          f"GPU kernels {p['kernel_ms']:.2f} ms, idle {p['wall_ms'] - p['kernel_ms']:.2f} ms, "
          f"floor {floor_ms:.2f} ms")  # fmt: skip
    for name, ms in p["top_kernels"]:
        print(f"    gpu  {ms:7.3f} ms/step  {name}")
    for name, ms in p["top_host"]:
        print(f"    host {ms:7.3f} ms/step  {name}")


def add_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("decode steps (--device cuda)")
    g.add_argument("--arch", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    g.add_argument("--num-layers", type=int, help="fewer layers than the architecture's")
    g.add_argument("--models-dir", type=Path, default=Path("/tmp/tandem-models"))
    g.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    g.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    g.add_argument("--requests", type=int, default=256, help="throughput: requests at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--cpu-kv-bytes", type=int, default=1 << 30, help="the KV pool on a CPU")
    g.add_argument(
        "--profile", action="store_true",
        help="instead of the sweep: torch.profiler over decode steps at --batches, first context",
    )  # fmt: skip


def made_model(arch: str, models_dir: Path, num_layers: int | None = None) -> Path:
    """`arch`'s `tandem make-model` folder under `models_dir`, written first if it is not there
    (random weights: the GPU machines download nothing)."""
    from engine.random_model import make_model

    name = arch if num_layers is None else f"{arch}-l{num_layers}"
    folder = models_dir / name
    if not (folder / "config.json").is_file():
        started = time.perf_counter()
        make_model(arch, folder, num_layers=num_layers)
        print(f"made {folder} in {time.perf_counter() - started:.0f} s", flush=True)
    return folder


def run(args: argparse.Namespace) -> dict:
    """The whole sweep; `args` as engine_throughput.py parses them (input/output lengths, dtype,
    device) with add_flags'."""
    bw = copy_bandwidth(args.device)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    results: list[dict] = []
    report: dict = {}
    for arch in args.arch:
        folder = made_model(arch, args.models_dir, args.num_layers)
        if args.profile:
            results.append(profile_arch(folder, arch, args, bw))
        else:
            results.append(bench_arch(folder, arch, args, bw))
            print_tables(results[-1:], bw)
        report = {"device": device, "copy_bandwidth_bytes_per_s": bw, "results": results}
        if args.json:  # after every architecture: a deadline keeps what was measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, default=str, indent=2))
    return report
