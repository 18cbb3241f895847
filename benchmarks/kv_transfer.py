"""KV transfer per transport: raw vs effective bandwidth, TTFT overhead, and interference.

    python benchmarks/kv_transfer.py [--model DIR] [--prompt-lens 2048] \
        [--transports gloo ipc ucx-shm ucx-tcp] [--repeats 3] [--skip-interference] \
        [--json results/kv_transfer.json]
    python benchmarks/kv_transfer.py --device cuda [--arch llama-3.2-1b llama-3.1-8b] \
        [--prompt-lens 1024 4096 16384] [--transports ipc gloo]

On CUDA the models are `tandem make-model` folders (random weights, published shapes) written
under --models-dir, both processes share the one GPU, and the raw rate is also given as a
fraction of the device's copy rate (bytes copied per second by a device-to-device copy).

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


def transfer_config(model: Path, prompt_len: int, device: str) -> EngineConfig:
    """A KV pool of a few prompts (on a GPU: three engines and the decode process share it)."""
    from engine.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # bf16 K and V
    return EngineConfig(
        model, device=device, enable_prefix_caching=False, max_num_batched_tokens=prompt_len,
        kv_cache_memory_bytes=max(1 << 28, 3 * prompt_len * per_token),
    )  # fmt: skip


class DecodeProcess:
    """A DecodeWorker in a spawned process, driven over a pipe: reserve, collect updates, and
    the receiving end of the raw link."""

    def __init__(self, config: EngineConfig, transport_name: str, raw_bytes: int) -> None:
        """The decode engine is on `config.device`, as is the raw receive's buffer."""
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
    device = torch.device(config.device)
    transport = make_transport(transport_name, device)
    decode = DecodeWorker("d-bench", LLMEngine(config), transport, TIMEOUT)
    rendezvous = Rendezvous("127.0.0.1")
    target = torch.empty(raw_bytes // 4, device=device)
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
                elif command == "raw":  # post the receives, answer, then wait for the bytes
                    accepting.join(TIMEOUT)
                    conn.send(_receive_layers(raw["rx"], target, arg, conn))
            except Exception as err:  # noqa: BLE001  (handed to the driver, which raises it)
                conn.send(RuntimeError(f"decode process: {err!r}"))
    finally:
        decode.shutdown()


def _receive_layers(channel, target: torch.Tensor, layers: int, conn) -> float:
    """Receives `layers` payloads into `target`'s equal parts, or in place where the channel
    lends its own memory (ipc: as the decode worker receives them); returns when the last was
    in place, by the clock both processes share (monotonic)."""
    part = target.numel() // layers
    lend = getattr(channel, "recv_lent_async", None)
    posted = []
    for i in range(layers):
        lent = lend((part,), target.dtype) if lend is not None else None
        posted.append(lent or channel.recv_async(target[i * part : (i + 1) * part]))
    conn.send("posted")
    for pending in posted:
        pending.wait(TIMEOUT)
        if getattr(pending, "tensor", None) is not None:
            pending.release()
    if target.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def measure_transfer(
    model: Path, prompt_len: int, repeats: int, transport_name: str, device: str = "cpu"
) -> dict:
    """Alone, raw, serialized and pipelined take turns within each round, so drift in the
    machine's load hits all of them alike; medians over the rounds after a warm-up round. On a
    GPU, serialized is left out (its weights would be a fourth copy on the one device)."""
    from engine.engine import LLMEngine
    from kvtransfer.transport import make_transport
    from prefill.worker import PrefillWorker

    config = transfer_config(model, prompt_len, device)
    transport = make_transport(transport_name, torch.device(device))
    alone_engine = LLMEngine(config)
    raw_bytes = alone_engine.kv_layout.bytes_for(prompt_len)
    decode = DecodeProcess(config, transport_name, raw_bytes)
    modes = {"pipelined": True} if device == "cuda" else {"serialized": False, "pipelined": True}
    prefills = {
        mode: PrefillWorker(f"p-{mode}", LLMEngine(config), transport, TIMEOUT, layered)
        for mode, layered in modes.items()
    }
    rows: dict[str, list] = {"alone": [], "raw": [], **{mode: [] for mode in prefills}}
    try:
        raw_tx = transport.connect(decode.raw_endpoint, "raw", TIMEOUT)
        source = torch.randn(raw_bytes // 4, device=device)
        for i in range(repeats + 1):  # round 0 warms up and opens the channels
            prompt = random_prompt(prompt_len, 100 + i)
            order = list(rows)
            for mode in order[i % len(order) :] + order[: i % len(order)]:  # rotating
                if mode == "alone":
                    run = _prefill_alone(alone_engine, prompt, device)
                elif mode == "raw":
                    layers = alone_engine.model_config.num_layers
                    run = _raw_send(raw_tx, source, decode, device, layers)
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

    kv_bytes = rows["pipelined"][0]["bytes"]
    alone = statistics.median(rows["alone"])
    raw_gbps = kv_bytes / statistics.median(rows["raw"]) / 1e9
    summary = {
        "kv_bytes": kv_bytes,
        "raw_gbps": raw_gbps,
        "ttft_alone_s": alone,
        "ttft_pipelined_s": median("pipelined", "ttft"),
        "overhead_pipelined_s": median("pipelined", "ttft") - alone,
        "overhead_pipelined_of_prefill": (median("pipelined", "ttft") - alone) / alone,
        "exposed_pipelined_s": median("pipelined", "exposed"),
    }
    if rows.get("serialized"):
        effective_gbps = kv_bytes / median("serialized", "transfer") / 1e9
        summary |= {
            "effective_gbps": effective_gbps,
            "effective_over_raw": effective_gbps / raw_gbps,
            "ttft_serialized_s": median("serialized", "ttft"),
            "overhead_serialized_s": median("serialized", "ttft") - alone,
            "exposed_serialized_s": median("serialized", "exposed"),
            "hidden_fraction": 1 - summary["exposed_pipelined_s"] / median("serialized", "exposed"),
        }
    return summary


def _prefill_alone(engine, prompt: list[int], device: str) -> float:
    """Colocated TTFT: the prompt's prefill and its first token on one engine."""
    start = time.perf_counter()
    engine.add_request(f"alone-{start}", prompt, FIRST_TOKEN)
    while engine.has_unfinished:
        engine.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _raw_send(
    channel, source: torch.Tensor, decode: DecodeProcess, device: str, layers: int
) -> float:
    """Seconds from the first send to the bytes being in the decode process, by the clock both
    processes share: the prompt's KV as its layers' payloads, back to back, as the layered
    transfer sends them (on a GPU the receive's copies are waited for there)."""
    if decode.call("raw", layers) != "posted":
        raise RuntimeError("the decode process did not post its receives")
    if device == "cuda":
        torch.cuda.synchronize()
    part = source.numel() // layers
    start = time.perf_counter()
    sends = [channel.send_async(source[i * part : (i + 1) * part]) for i in range(layers)]
    for pending in sends:
        pending.wait(TIMEOUT)
    return decode.answer() - start  # when the last byte was in place


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
    """Colocated against 1P1D on the same hardware: on CPU two workers of one thread each; on
    a GPU one worker with the whole device against two with half each (KV over `auto`: CUDA
    IPC)."""
    from coordinator.builder import DeployConfig, build_client

    cuda = args.device == "cuda"
    engine = EngineConfig(
        model, device=args.device, max_num_batched_tokens=args.long_len,
        kv_cache_memory_bytes=(4 << 30) if cuda else (1 << 29),
    )  # fmt: skip
    layouts = {
        "colocated": DeployConfig(
            mode="colocated", num_prefill=0 if cuda else 1, num_decode=1, threads_per_worker=1
        ),
        "disaggregated": DeployConfig(
            num_prefill=1, num_decode=1, threads_per_worker=1, gpus_per_worker=0.5 if cuda else 1
        ),
    }
    results = {}
    for mode, deploy in layouts.items():
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


def available_transports(device: str) -> list[str]:
    if device == "cuda":
        return ["ipc", "gloo"]
    ucx = importlib.util.find_spec("ucxx") is not None
    return ["gloo", "ipc", *(["ucx-shm", "ucx-tcp"] if ucx else [])]


def models(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(name, folder) per model: --model, or on CUDA a make-model folder per --arch."""
    if args.device != "cuda":
        if args.model is None:
            from engine.fetch import fetch_default_model

            args.model = fetch_default_model()
        return [(args.model.name, args.model)]
    from benchmarks.decode_steps import made_model

    return [(arch, made_model(arch, args.models_dir)) for arch in args.arch]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", type=Path, default=None, help="CPU: default SmolLM2")
    parser.add_argument("--arch", nargs="+", default=["llama-3.2-1b"], help="CUDA: make-model")
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/tandem-models"))
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=None,
                        help="default 2048 on CPU; 1024 4096 16384 on CUDA")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--transports", nargs="+", default=None,
        help="gloo, ipc, ucx, ucx-shm, ucx-tcp (default: gloo, ipc, and ucx-shm and ucx-tcp if "
        "installed; ipc and gloo on CUDA)",
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
    report: dict = {"device": args.device, "runs": []}
    if args.device == "cuda":
        from benchmarks.decode_steps import copy_bandwidth

        report["device"] = torch.cuda.get_device_name()
        report["copy_gbps"] = copy_bandwidth("cuda") / 2 / 1e9  # bytes copied, not touched
    folders = models(args)
    for name, folder in folders:
        for prompt_len in args.prompt_lens or (
            [2048] if args.device == "cpu" else [1024, 4096, 16384]
        ):
            run = {"model": name, "prompt_len": prompt_len, "transports": {}}
            for transport in args.transports or available_transports(args.device):
                run["transports"][transport] = measure_transfer(
                    folder, prompt_len, args.repeats, transport, args.device
                )
            report["runs"].append(run)
            print_run(run, report.get("copy_gbps"))
            write(report, args.json)  # after every run: a deadline keeps what was measured
    if not args.skip_interference:
        report["interference"] = measure_interference(folders[0][1], args)
        print_interference(report["interference"])
        write(report, args.json)
    print(f"\nJSON: {args.json}")


def write(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


def print_run(r: dict, copy_gbps: float | None) -> None:
    kv_mb = next(iter(r["transports"].values()))["kv_bytes"] / 1e6
    print(f"\nKV transfer, {r['model']}, {r['prompt_len']}-token prompts ({kv_mb:.1f} MB of KV), "
          "prefill process -> decode process; medians")  # fmt: skip
    if copy_gbps is not None:  # a GPU: no serialized run
        print(f"device copy: {copy_gbps:.0f} GB/s")
        header = ("transport", "raw GB/s", "of copy", "TTFT alone", "+pipelined", "of prefill",
                  "exposed")  # fmt: skip
        print(f"{header[0]:<10}" + "".join(f"{h:>12}" for h in header[1:]))
        for name, t in r["transports"].items():
            print(f"{name:<10}{t['raw_gbps']:>12.1f}{t['raw_gbps'] / copy_gbps:>12.0%}"
                  f"{t['ttft_alone_s'] * 1e3:>10.1f}ms{t['overhead_pipelined_s'] * 1e3:>+10.1f}ms"
                  f"{t['overhead_pipelined_of_prefill']:>12.0%}"
                  f"{t['exposed_pipelined_s'] * 1e3:>10.1f}ms")  # fmt: skip
        print("targets: a same-device transfer >= 80% of copy; added TTFT <= 10% of prefill at 4k")
        return
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


def print_interference(r: dict) -> None:
    print(f"\n{'mixed workload':<16}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}")
    for mode, m in r.items():
        print(f"{mode:<16}" + "".join(f"{m[k] * 1e3:>8.1f}ms" for k in
              ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")))  # fmt: skip
    ratio = r["disaggregated"]["itl_p99_s"] / r["colocated"]["itl_p99_s"]
    print(f"disaggregated p99 ITL = {ratio:.2f} x colocated (target <= 0.5)")


if __name__ == "__main__":
    main()
