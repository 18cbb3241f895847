"""KV transfer: raw vs effective bandwidth, what layer pipelining hides, and interference.

    python benchmarks/kv_transfer.py [--model DIR] [--prompt-len 2048] [--transport gloo] \
        [--skip-interference] [--json results/kv_transfer.json]

1. Bandwidth: one contiguous buffer of a prompt's KV size over the transport (raw), and the KV
   of real prompts moved layer by layer into reserved blocks (effective = bytes / transfer time
   when sent after prefill, so compute does not pace it). Every measurement takes turns with
   the others in rounds (the order rotating), and each row is a median over the rounds.
2. TTFT on the prefill side: prefill alone; prefill then send (serialized); layer-pipelined.
   The transfer is a few percent of a CPU prefill, below this machine's run-to-run noise, so
   what pipelining hides is measured inside each run instead: the transfer time left after the
   prefill step ends (what TTFT pays), serialized vs pipelined.
3. Interference (Ray pools, one torch thread per worker, same total cores): short requests
   decode while long prompts arrive; colocated (2 workers) vs disaggregated (1P1D).
All measured in one run; the machine is shared and noisy, so compare ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.requests import WorkRequest  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


class RawLink:
    """One channel between two threads of this process, for the raw-bandwidth baseline: one
    contiguous buffer per send, no framing, no pack or unpack."""

    def __init__(self, transport_name: str, nbytes: int) -> None:
        from kvtransfer.transport import Rendezvous, make_transport

        transport = make_transport(transport_name, torch.device("cpu"))
        rendezvous = Rendezvous("127.0.0.1")
        accepted = {}
        accept = threading.Thread(
            target=lambda: accepted.setdefault("rx", transport.accept(rendezvous.store, "raw", 30))
        )
        accept.start()
        self.tx = transport.connect(rendezvous.endpoint, "raw", 30)
        accept.join(30)
        self.rx = accepted["rx"]
        self.source = torch.randn(nbytes // 4)
        self.target = torch.empty_like(self.source)

    def seconds(self) -> float:
        start = time.perf_counter()
        arriving = self.rx.recv_async(self.target)
        self.tx.send(self.source, 60)
        arriving.wait(60)
        return time.perf_counter() - start


def measure_transfer(model: Path, prompt_len: int, repeats: int, transport_name: str) -> dict:
    """Alone, serialized and pipelined take turns within each round, so drift in the machine's
    load hits all three alike; medians over the rounds after a warm-up round."""
    from decode.worker import DecodeWorker
    from engine.engine import LLMEngine
    from kvtransfer.transport import make_transport
    from prefill.worker import PrefillWorker, kv_layout

    config = EngineConfig(
        model, enable_prefix_caching=False, max_num_batched_tokens=prompt_len,
        kv_cache_memory_bytes=1 << 28,
    )  # fmt: skip
    transport = make_transport(transport_name, torch.device("cpu"))
    alone_engine = LLMEngine(config)
    decode = DecodeWorker("d-bench", config, transport, 120.0)
    prefills = {
        "serialized": PrefillWorker("p-serialized", config, transport, 120.0, False),
        "pipelined": PrefillWorker("p-pipelined", config, transport, 120.0, True),
    }
    raw = RawLink(transport_name, kv_layout(alone_engine).bytes_for(prompt_len))
    rows: dict[str, list] = {"alone": [], "serialized": [], "pipelined": [], "raw": []}
    try:
        for i in range(repeats + 1):  # round 0 warms up and opens the channels
            prompt = random_prompt(prompt_len, 100 + i)
            modes = ["alone", "raw", *prefills]
            for mode in modes[i % 4 :] + modes[: i % 4]:  # each round in another order
                if mode == "alone":
                    run = _prefill_alone(alone_engine, prompt)
                elif mode == "raw":
                    run = raw.seconds()
                else:
                    run = _remote_prefill(prefills[mode], decode, prompt, f"{mode}{i}")
                if i > 0:
                    rows[mode].append(run)
    finally:
        for worker in prefills.values():
            worker.shutdown()
        decode.shutdown()
    alone = statistics.median(rows["alone"])
    serialized = statistics.median(r["ttft"] for r in rows["serialized"])
    pipelined = statistics.median(r["ttft"] for r in rows["pipelined"])
    kv_bytes = rows["serialized"][0]["bytes"]
    transfer = statistics.median(r["transfer"] for r in rows["serialized"])
    exposed = {m: statistics.median(r["exposed"] for r in rows[m]) for m in prefills}
    raw_seconds = statistics.median(rows["raw"])
    return {
        "raw_gbps": kv_bytes / raw_seconds / 1e9,
        "hidden_fraction": 1 - exposed["pipelined"] / exposed["serialized"],
        "kv_bytes": kv_bytes,
        "transfer_s": transfer,
        "effective_gbps": kv_bytes / transfer / 1e9,
        "ttft_alone_s": alone,
        "ttft_serialized_s": serialized,
        "ttft_pipelined_s": pipelined,
        "exposed_serialized_s": statistics.median(r["exposed"] for r in rows["serialized"]),
        "exposed_pipelined_s": statistics.median(r["exposed"] for r in rows["pipelined"]),
    }


def _prefill_alone(engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request(f"alone-{start}", prompt, FIRST_TOKEN)
    while engine.has_unfinished:
        engine.step()
    return time.perf_counter() - start


def _remote_prefill(prefill, decode, prompt: list[int], request_id: str) -> dict:
    request = WorkRequest(request_id, prompt, FIRST_TOKEN)
    ticket = decode.reserve(request, prefill.worker_id).result(60)
    done = threading.Event()
    outcome = {}

    def settle(_, result) -> None:
        outcome["result"] = result
        done.set()

    start = time.perf_counter()
    prefill.submit(request, ticket, settle)
    if not done.wait(300):
        raise TimeoutError("prefill did not finish")
    ttft = time.perf_counter() - start
    result = outcome["result"]
    if isinstance(result, Exception):
        raise result
    decode.take_updates(timeout=5)  # admitted and finished at once (max_tokens=1)
    return {
        "ttft": ttft,
        "bytes": result.bytes_sent,
        "transfer": result.transfer_seconds,
        "exposed": result.exposed_seconds,
    }


# -- interference ------------------------------------------------------------------------------


async def mixed_workload(client, args: argparse.Namespace) -> dict:
    """Short requests decode the whole time; long prompts arrive every `--long-every` s."""
    short = SamplingParams(max_tokens=args.short_output, temperature=0, ignore_eos=True)
    long = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ttfts: dict[str, list[float]] = {"short": [], "long": []}
    itls: list[float] = []

    async def one(kind: str, prompt: list[int], params, request_id: str) -> None:
        start = last = time.perf_counter()
        async for output in client.generate(prompt, params, request_id):
            now = time.perf_counter()
            if len(output.token_ids) == len(output.delta_token_ids):
                ttfts[kind].append(now - start)
            elif kind == "short":
                itls.extend(
                    [(now - last) / len(output.delta_token_ids)] * len(output.delta_token_ids)
                )
            last = now

    long_tasks: list[asyncio.Future] = []

    async def longs() -> None:
        await asyncio.sleep(args.long_every / 2)
        for i in range(args.num_long):
            prompt = random_prompt(args.long_len, 900 + i)
            long_tasks.append(asyncio.ensure_future(one("long", prompt, long, f"L{i}")))
            await asyncio.sleep(args.long_every)

    shorts = [
        one("short", random_prompt(64, 500 + i), short, f"S{i}") for i in range(args.num_short)
    ]
    await asyncio.gather(*shorts, longs())
    await asyncio.gather(*long_tasks)
    return {
        "ttft_p50_s": _pct(ttfts["short"] + ttfts["long"], 50),
        "ttft_p99_s": _pct(ttfts["short"] + ttfts["long"], 99),
        "itl_p50_s": _pct(itls, 50),
        "itl_p99_s": _pct(itls, 99),
        "itl_count": len(itls),
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def measure_interference(model: Path, args: argparse.Namespace) -> dict:
    from coordinator.builder import DeployConfig, build_client

    engine = EngineConfig(
        model, max_num_batched_tokens=args.long_len, kv_cache_memory_bytes=1 << 29
    )
    results = {}
    for mode in ("colocated", "disaggregated"):
        deploy = DeployConfig(mode=mode, num_prefill=1, num_decode=1, threads_per_worker=1)
        client = build_client(engine, deploy)

        async def run(client=client):
            await client.ready()
            try:
                return await asyncio.wait_for(mixed_workload(client, args), 600)
            finally:
                await client.shutdown()

        results[mode] = asyncio.run(run())
        import ray

        for handle in (*client.prefill.values(), *client.decode.values()):
            ray.kill(handle)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transport", default="gloo")
    parser.add_argument("--skip-interference", action="store_true")
    parser.add_argument("--num-short", type=int, default=6)
    parser.add_argument("--short-output", type=int, default=96)
    parser.add_argument("--num-long", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=1024)
    parser.add_argument("--long-every", type=float, default=2.0)
    parser.add_argument("--json", type=Path, default=ROOT / "results" / "kv_transfer.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the prefill compute thread; the sender gets the other core
    if args.model is None:
        from engine.fetch import fetch_default_model

        args.model = fetch_default_model()
    transfer = measure_transfer(args.model, args.prompt_len, args.repeats, args.transport)
    report = {"transport": args.transport, "prompt_len": args.prompt_len, **transfer,
              "effective_over_raw": transfer["effective_gbps"] / transfer["raw_gbps"]}  # fmt: skip
    if not args.skip_interference:
        report["interference"] = measure_interference(args.model, args)
    print_report(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nJSON: {args.json}")


def print_report(r: dict) -> None:
    print(f"\nKV transfer, {r['prompt_len']}-token prompts, transport {r['transport']}, "
          f"{r['kv_bytes'] / 1e6:.1f} MB of KV per prompt")  # fmt: skip
    print(f"{'raw bandwidth (one buffer)':<34}{r['raw_gbps']:>8.2f} GB/s")
    print(f"{'effective KV bandwidth':<34}{r['effective_gbps']:>8.2f} GB/s"
          f"   ({r['effective_over_raw']:.0%} of raw; target >= 80%)")  # fmt: skip
    print(f"{'TTFT prefill alone':<34}{r['ttft_alone_s'] * 1e3:>8.0f} ms")
    print(f"{'TTFT prefill, then send':<34}{r['ttft_serialized_s'] * 1e3:>8.0f} ms")
    print(f"{'TTFT layer-pipelined':<34}{r['ttft_pipelined_s'] * 1e3:>8.0f} ms")
    print(f"{'transfer left after prefill ends':<34}"
          f"{r['exposed_serialized_s'] * 1e3:>8.1f} ms serialized, "
          f"{r['exposed_pipelined_s'] * 1e3:.1f} ms pipelined: pipelining hides "
          f"{r['hidden_fraction']:.0%} (target >= 80%)")  # fmt: skip
    if "interference" not in r:
        return
    print(f"\n{'mixed workload':<16}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}")
    for mode, m in r["interference"].items():
        print(f"{mode:<16}" + "".join(f"{m[k] * 1e3:>8.0f}ms" for k in
              ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")))  # fmt: skip
    ratio = (
        r["interference"]["disaggregated"]["itl_p99_s"]
        / r["interference"]["colocated"]["itl_p99_s"]
    )
    print(f"disaggregated p99 ITL = {ratio:.2f} x colocated (target <= 0.5)")


if __name__ == "__main__":
    main()
