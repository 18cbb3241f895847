"""Transport bandwidth between two processes: raw, and layer by layer the way KV moves.

    python benchmarks/transport_bandwidth.py [--transports gloo ucx-shm ucx-tcp] \
        [--prompt-len 2048] [--mbytes N] [--repeats 10] [--json out.json]

raw:     one contiguous buffer (by default the size of the prompt's KV), `repeats` times after
         one warm-up, timed on the receiver.
layered: the KV of one `prompt-len` prompt of SmolLM2-135M (30 layers, 3 KV heads, head dim 64,
         bf16) the way KVSender and KVReceiver move it: one 128-byte step frame, then one payload
         per layer with up to 8 sends in flight, every payload receive posted when the frame
         lands into staging buffers reused from run to run (as KVReceiver's); timed on the
         receiver from the frame to the last payload, median of `repeats`. `--fresh-buffers`
         allocates them per run instead (first-touch page faults cost about half here).
Both sides are spawned processes on this host, so shared memory is in play where a transport
uses it. CPU tensors only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

TIMEOUT = 60.0
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
FRAME_BYTES = 128  # as kvtransfer.wire's frames
WINDOW = 8  # sends in flight, as KVSender


def raw_bandwidth(transport_name: str, nbytes: int, repeats: int) -> float:
    """GB/s for one contiguous `nbytes` buffer from one process to another."""
    seconds = _run_pair(transport_name, ("raw", nbytes, repeats))
    return nbytes * repeats / seconds / 1e9


def layered_bandwidth(
    transport_name: str, prompt_len: int, repeats: int, fresh_buffers: bool = False
) -> float:
    """GB/s moving one prompt's KV layer by layer (frame + payload per layer), median run."""
    kind = "layered-fresh" if fresh_buffers else "layered"
    seconds = _run_pair(transport_name, (kind, prompt_len, repeats))
    return _kv_bytes(prompt_len) / seconds / 1e9


def _kv_bytes(prompt_len: int) -> int:
    return LAYERS * 2 * prompt_len * KV_HEADS * HEAD_DIM * 2


def _run_pair(transport_name: str, job: tuple[str, int, int]) -> float:
    context = mp.get_context("spawn")
    results = context.Queue()
    receiver = context.Process(target=_receive, args=(transport_name, job, results))
    receiver.start()
    endpoint = results.get(timeout=TIMEOUT)
    sender = context.Process(target=_send, args=(transport_name, job, endpoint))
    sender.start()
    try:
        outcome = results.get(timeout=TIMEOUT * 4)
    finally:
        for process in (sender, receiver):
            process.join(TIMEOUT)
            if process.is_alive():
                process.kill()
    if isinstance(outcome, str):
        raise RuntimeError(f"{transport_name}: {outcome}")
    return outcome


def _receive(transport_name: str, job: tuple[str, int, int], results) -> None:
    import kvtransfer.ucx  # noqa: F401  (registers the ucx variants)
    from kvtransfer.transport import Rendezvous, make_transport

    try:
        transport = make_transport(transport_name, torch.device("cpu"))
        rendezvous = Rendezvous("127.0.0.1")
        results.put(rendezvous.endpoint)
        channel = transport.accept(rendezvous.store, "bench", TIMEOUT)
        kind, size, repeats = job
        if kind == "raw":
            buffer = torch.empty(size, dtype=torch.uint8)
            channel.recv(buffer, TIMEOUT)  # warm-up
            start = time.perf_counter()
            for _ in range(repeats):
                channel.recv(buffer, TIMEOUT)
            results.put(time.perf_counter() - start)
            return
        times, payloads = [], []
        for _ in range(repeats + 1):
            frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
            channel.recv(frame, TIMEOUT)
            start = time.perf_counter()
            num_tokens = int(frame.view(torch.int64)[0])
            shape = (2, num_tokens, KV_HEADS, HEAD_DIM)
            if kind == "layered-fresh" or not payloads:
                payloads = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
            for pending in [channel.recv_async(payload) for payload in payloads]:
                pending.wait(TIMEOUT)
            times.append(time.perf_counter() - start)
        results.put(statistics.median(times[1:]))  # the first run warms up
    except Exception as err:  # reported to the parent, which raises it
        results.put(f"{type(err).__name__}: {err}")


def _send(transport_name: str, job: tuple[str, int, int], endpoint) -> None:
    import kvtransfer.ucx  # noqa: F401
    from kvtransfer.transport import make_transport

    transport = make_transport(transport_name, torch.device("cpu"))
    channel = transport.connect(endpoint, "bench", TIMEOUT)
    kind, size, repeats = job
    if kind == "raw":
        buffer = torch.ones(size, dtype=torch.uint8)
        for _ in range(repeats + 1):
            channel.send(buffer, TIMEOUT)
    else:
        payloads = [
            torch.randn((2, size, KV_HEADS, HEAD_DIM)).to(torch.bfloat16) for _ in range(LAYERS)
        ]
        in_flight: deque = deque()
        for _ in range(repeats + 1):
            frame = torch.zeros(FRAME_BYTES // 8, dtype=torch.int64)
            frame[0] = size
            for tensor in (frame.view(torch.uint8), *payloads):
                in_flight.append(channel.send_async(tensor))
                while len(in_flight) > WINDOW:
                    in_flight.popleft().wait(TIMEOUT)
        while in_flight:
            in_flight.popleft().wait(TIMEOUT)
    time.sleep(1.0)  # let the receiver finish before this side hangs up
    channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", nargs="+", default=["gloo", "ucx-shm", "ucx-tcp"])
    parser.add_argument("--mbytes", type=float, help="raw buffer size (default: the KV size)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--fresh-buffers", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    raw_bytes = int(args.mbytes * 2**20) if args.mbytes else _kv_bytes(args.prompt_len)
    rows = []
    for name in args.transports:
        raw = raw_bandwidth(name, raw_bytes, args.repeats)
        layered = layered_bandwidth(name, args.prompt_len, args.repeats, args.fresh_buffers)
        rows.append({"transport": name, "raw_gbps": raw, "layered_gbps": layered})
        print(f"{name}: raw {raw:.2f} GB/s, layered {layered:.2f} GB/s", flush=True)
    kv_mb = _kv_bytes(args.prompt_len) / 1e6
    print(f"\nraw: {raw_bytes / 1e6:.1f} MB buffers", end="; ")
    print(f"layered: the KV of a {args.prompt_len}-token prompt ({kv_mb:.1f} MB)")
    print(f"{'transport':<10} {'raw GB/s':>9} {'layered GB/s':>13} {'layered/raw':>12}")
    for row in rows:
        ratio = row["layered_gbps"] / row["raw_gbps"]
        print(
            f"{row['transport']:<10} {row['raw_gbps']:>9.2f} {row['layered_gbps']:>13.2f} "
            f"{ratio:>11.0%}"
        )
    report = {"raw_bytes": raw_bytes, "prompt_len": args.prompt_len, "rows": rows}
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
