"""KV transfer per transport: raw vs effective bandwidth, TTFT overhead, and interference.

    python benchmarks/kv_transfer.py [--model DIR] [--prompt-len 2048] \
        [--transports gloo ucx-shm ucx-tcp] [--repeats 3] [--skip-interference] \
        [--json results/kv_transfer.json]

1. Per transport, between this process (prefill, one torch thread, plus its sender thread) and
   a spawned decode process (one torch thread), as in a deployment with one worker per core:
   - raw: one contiguous buffer of a prompt's KV size, one send;
   - effective: the KV of a real prompt moved layer by layer into reserved decode blocks, timed
     from the first layer sent to the done frame, when sent after prefill (so compute does not
     pace it): bytes / that time;
   - TTFT on the prefill side: prefill alone (no transfer), prefill then send (serialized), and
     layer-pipelined; the overhead is each minus alone. The transfer is a few percent of a CPU
     prefill, near this machine's run-to-run noise, so what pipelining hides is also measured
     inside each run: the transfer time left after the prefill step ends (what TTFT pays).
   Within a transport, every measurement takes turns with the others in rounds (the order
   rotating); each figure is a median over the rounds after a warm-up round.
2. Interference (Ray pools, one torch thread per worker, same total cores): short requests
   decode while long prompts arrive; colocated (2 workers) vs disaggregated (1P1D).
All measured in one run; the machine is shared and noisy, so compare ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing as mp
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
from protocol.messages import WorkRequest  # noqa: E402
from protocol.sampling import SamplingParams  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
TIMEOUT = 120.0


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


def transfer_config(model: Path, prompt_len: int) -> EngineConfig:
    return EngineConfig(
        model, enable_prefix_caching=False, max_num_batched_tokens=prompt_len,
        kv_cache_memory_bytes=1 << 28,
    )  # fmt: skip


class DecodeProcess:
    """A DecodeWorker in a spawned process, driven over a pipe: reserve, collect updates, and
    the receiving end of the raw link."""

    def __init__(self, config: EngineConfig, transport_name: str, raw_bytes: int) -> None:
        self.conn, child = mp.Pipe()
        self.process = mp.get_context("spawn").Process(
            target=_decode_main, args=(config, transport_name, raw_bytes, child), daemon=True
        )
        self.process.start()
        self.raw_endpoint = self.answer()

    def call(self, command: str, arg=None):
        self.conn.send((command, arg))
        return self.answer()

    def answer(self):
        deadline = time.monotonic() + TIMEOUT
        while not self.conn.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(f"the decode process died (exit {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError("the decode process did not answer")
        answer = self.conn.recv()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(("stop", None))
            self.process.join(30)
        self.process.kill()


def _decode_main(config: EngineConfig, transport_name: str, raw_bytes: int, conn) -> None:
    from decode.worker import DecodeWorker
    from engine.engine import LLMEngine
    from kvtransfer.transport import Rendezvous, make_transport

    torch.set_num_threads(1)
    transport = make_transport(transport_name, torch.device("cpu"))
    decode = DecodeWorker("d-bench", LLMEngine(config), transport, TIMEOUT)
    rendezvous = Rendezvous("127.0.0.1")
    target = torch.empty(raw_bytes // 4)
    raw = {}
    accepting = threading.Thread(
        target=lambda: raw.setdefault("rx", transport.accept(rendezvous.store, "raw", TIMEOUT))
    )
    accepting.start()
    conn.send(rendezvous.endpoint)
    try:
        while True:
            command, arg = conn.recv()
            if command == "stop":
                return
            try:
                if command == "reserve":
                    conn.send(decode.reserve(*arg).result(TIMEOUT))
                elif command == "updates":  # admitted and finished at once (max_tokens=1)
                    conn.send(len(decode.take_updates(timeout=5)))
                elif command == "raw":  # post the receive, answer, then wait for the bytes
                    accepting.join(TIMEOUT)
                    arriving = raw["rx"].recv_async(target)
                    conn.send("posted")
                    arriving.wait(TIMEOUT)
                    conn.send("received")
            except Exception as err:  # noqa: BLE001  (handed to the driver, which raises it)
                conn.send(RuntimeError(f"decode process: {err!r}"))
    finally:
        decode.shutdown()


def measure_transfer(model: Path, prompt_len: int, repeats: int, transport_name: str) -> dict:
    """Alone, raw, serialized and pipelined take turns within each round, so drift in the
    machine's load hits all of them alike; medians over the rounds after a warm-up round."""
    from engine.engine import LLMEngine
    from kvtransfer.transport import make_transport
    from prefill.worker import PrefillWorker

    config = transfer_config(model, prompt_len)
    transport = make_transport(transport_name, torch.device("cpu"))
    alone_engine = LLMEngine(config)
    raw_bytes = alone_engine.kv_layout.bytes_for(prompt_len)
    decode = DecodeProcess(config, transport_name, raw_bytes)
    prefills = {
        "serialized": PrefillWorker("p-serialized", LLMEngine(config), transport, TIMEOUT, False),
        "pipelined": PrefillWorker("p-pipelined", LLMEngine(config), transport, TIMEOUT, True),
    }
    rows: dict[str, list] = {"alone": [], "serialized": [], "pipelined": [], "raw": []}
    try:
        raw_tx = transport.connect(decode.raw_endpoint, "raw", TIMEOUT)
        source = torch.randn(raw_bytes // 4)
        for i in range(repeats + 1):  # round 0 warms up and opens the channels
            prompt = random_prompt(prompt_len, 100 + i)
            modes = ["alone", "raw", *prefills]
            for mode in modes[i % 4 :] + modes[: i % 4]:  # each round in another order
                if mode == "alone":
                    run = _prefill_alone(alone_engine, prompt)
                elif mode == "raw":
                    run = _raw_send(raw_tx, source, decode)
                else:
                    run = _remote_prefill(prefills[mode], decode, prompt, f"{mode}{i}")
                if i > 0:
                    rows[mode].append(run)
    finally:
        for worker in prefills.values():
            worker.shutdown()
        decode.close()
    return _summary(rows)


def _summary(rows: dict[str, list]) -> dict:
    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[mode])

    kv_bytes = rows["serialized"][0]["bytes"]
    alone = statistics.median(rows["alone"])
    exposed = {m: median(m, "exposed") for m in ("serialized", "pipelined")}
    ttft = {m: median(m, "ttft") for m in ("serialized", "pipelined")}
    raw_gbps = kv_bytes / statistics.median(rows["raw"]) / 1e9
    effective_gbps = kv_bytes / median("serialized", "transfer") / 1e9
    return {
        "kv_bytes": kv_bytes,
        "raw_gbps": raw_gbps,
        "effective_gbps": effective_gbps,
        "effective_over_raw": effective_gbps / raw_gbps,
        "ttft_alone_s": alone,
        "ttft_serialized_s": ttft["serialized"],
        "ttft_pipelined_s": ttft["pipelined"],
        "overhead_serialized_s": ttft["serialized"] - alone,
        "overhead_pipelined_s": ttft["pipelined"] - alone,
        "exposed_serialized_s": exposed["serialized"],
        "exposed_pipelined_s": exposed["pipelined"],
        "hidden_fraction": 1 - exposed["pipelined"] / exposed["serialized"],
    }


def _prefill_alone(engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request(f"alone-{start}", prompt, FIRST_TOKEN)
    while engine.has_unfinished:
        engine.step()
    return time.perf_counter() - start


def _raw_send(channel, source: torch.Tensor, decode: DecodeProcess) -> float:
    """Seconds to send one buffer, timed on the sender as the layered transfer is."""
    if decode.call("raw") != "posted":
        raise RuntimeError("the decode process did not post its receive")
    start = time.perf_counter()
    channel.send(source, TIMEOUT)
    seconds = time.perf_counter() - start
    decode.answer()  # received
    return seconds


def _remote_prefill(prefill, decode: DecodeProcess, prompt: list[int], request_id: str) -> dict:
    request = WorkRequest(request_id, prompt, FIRST_TOKEN)
    ticket = decode.call("reserve", (request, prefill.worker_id))
    done = threading.Event()
    outcome = {}

    def settle(_, result) -> None:
        outcome["result"] = result
        done.set()

    start = time.perf_counter()
    prefill.submit(request, ticket, settle)
    if not done.wait(TIMEOUT):
        raise TimeoutError("prefill did not finish")
    ttft = time.perf_counter() - start
    report = outcome["result"]
    if isinstance(report, Exception):
        raise report
    decode.call("updates")
    return {
        "ttft": ttft,
        "bytes": report.result.bytes_sent,
        "transfer": report.trace.transfer_seconds,
        "exposed": report.trace.exposed_seconds,
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


def available_transports() -> list[str]:
    ucx = importlib.util.find_spec("ucxx") is not None
    return ["gloo", *(["ucx-shm", "ucx-tcp"] if ucx else [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--transports", nargs="+", default=None,
        help="gloo, ucx, ucx-shm, ucx-tcp (default: gloo, and ucx-shm and ucx-tcp if installed)",
    )  # fmt: skip
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
    report: dict = {"prompt_len": args.prompt_len, "transports": {}}
    for name in args.transports or available_transports():
        report["transports"][name] = measure_transfer(
            args.model, args.prompt_len, args.repeats, name
        )
    if not args.skip_interference:
        report["interference"] = measure_interference(args.model, args)
    print_report(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nJSON: {args.json}")


def print_report(r: dict) -> None:
    kv_mb = next(iter(r["transports"].values()))["kv_bytes"] / 1e6
    print(f"\nKV transfer, {r['prompt_len']}-token prompts ({kv_mb:.1f} MB of KV), prefill "
          "process -> decode process; medians")  # fmt: skip
    header = ("transport", "raw GB/s", "eff GB/s", "eff/raw", "TTFT alone", "+serial",
              "+pipelined", "exposed s/p", "hidden")  # fmt: skip
    print(f"{header[0]:<10}" + "".join(f"{h:>12}" for h in header[1:]))
    for name, t in r["transports"].items():
        exposed = f"{t['exposed_serialized_s'] * 1e3:.1f}/{t['exposed_pipelined_s'] * 1e3:.1f}ms"
        print(f"{name:<10}{t['raw_gbps']:>12.2f}{t['effective_gbps']:>12.2f}"
              f"{t['effective_over_raw']:>12.0%}{t['ttft_alone_s'] * 1e3:>10.0f}ms"
              f"{t['overhead_serialized_s'] * 1e3:>+10.0f}ms"
              f"{t['overhead_pipelined_s'] * 1e3:>+10.0f}ms{exposed:>12}"
              f"{t['hidden_fraction']:>12.0%}")  # fmt: skip
    print("targets: eff/raw >= 80%; hidden (transfer left after prefill ends, pipelined vs "
          "serialized) >= 80%")  # fmt: skip
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
