"""Transport bandwidth between two processes: raw, and layer by layer the way KV moves.

    python benchmarks/transport_bandwidth.py [--transports gloo ucx-shm ucx-tcp] \
        [--prompt-len 2048] [--rounds 10] [--fresh-buffers] [--json out.json]

Each round moves, over one channel between two spawned processes on this host:
  raw:     one contiguous buffer the size of the prompt's KV;
  layered: the KV of one `prompt-len` prompt of SmolLM2-135M (30 layers, 3 KV heads, head dim
           64, bf16) the way KVSender and KVReceiver move it: a 128-byte step frame, then one
           payload per layer with up to 8 sends in flight, every payload receive posted when the
           frame lands, into staging buffers reused from round to round (as KVReceiver's;
           `--fresh-buffers` allocates them every round: first-touch page faults, which cost up
           to half the bandwidth in some runs here).
Both are timed on the receiver (layered: from the frame to the last payload). Rounds alternate,
so a load change on a shared machine hits both alike; the table gives medians over the rounds
after a warm-up one. CPU tensors only.
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
    """GB/s for one contiguous `nbytes` buffer from one process to another (median of
    `repeats` after a warm-up)."""
    times = _run_pair(transport_name, ("raw", nbytes, repeats))
    return nbytes / statistics.median(times["raw"]) / 1e9


def compare(transport_name: str, prompt_len: int, rounds: int, fresh_buffers: bool = False):
    """Median GB/s of raw and layered transfers of one prompt's KV, in alternating rounds."""
    kind = "rounds-fresh" if fresh_buffers else "rounds"
    times = _run_pair(transport_name, (kind, prompt_len, rounds))
    nbytes = kv_bytes(prompt_len)
    raw, layered = (nbytes / statistics.median(times[k]) / 1e9 for k in ("raw", "layered"))
    return {"transport": transport_name, "raw_gbps": raw, "layered_gbps": layered}


def kv_bytes(prompt_len: int) -> int:
    return LAYERS * 2 * prompt_len * KV_HEADS * HEAD_DIM * 2


def _run_pair(transport_name: str, job: tuple[str, int, int]) -> dict[str, list[float]]:
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


def _transport(transport_name: str):
    import kvtransfer.ucx  # noqa: F401  (registers the ucx-shm and ucx-tcp variants)
    from kvtransfer.transport import make_transport

    return make_transport(transport_name, torch.device("cpu"))


def _receive(transport_name: str, job: tuple[str, int, int], results) -> None:
    from kvtransfer.transport import Rendezvous

    try:
        transport = _transport(transport_name)
        rendezvous = Rendezvous("127.0.0.1")
        results.put(rendezvous.endpoint)
        channel = transport.accept(rendezvous.store, "bench", TIMEOUT)
        kind, size, repeats = job
        nbytes = size if kind == "raw" else kv_bytes(size)
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        times: dict[str, list[float]] = {"raw": [], "layered": []}
        payloads: list[torch.Tensor] = []
        for _ in range(repeats + 1):  # the first round warms up
            start = time.perf_counter()
            channel.recv(buffer, TIMEOUT)
            times["raw"].append(time.perf_counter() - start)
            if kind != "raw":
                if kind == "rounds-fresh" or not payloads:
                    shape = (2, size, KV_HEADS, HEAD_DIM)
                    payloads = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
                times["layered"].append(_receive_layers(channel, payloads))
        results.put({key: values[1:] for key, values in times.items()})
    except Exception as err:  # reported to the parent, which raises it
        results.put(f"{type(err).__name__}: {err}")


def _receive_layers(channel, payloads: list[torch.Tensor]) -> float:
    frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
    channel.recv(frame, TIMEOUT)
    start = time.perf_counter()
    for pending in [channel.recv_async(payload) for payload in payloads]:
        pending.wait(TIMEOUT)
    return time.perf_counter() - start


def _send(transport_name: str, job: tuple[str, int, int], endpoint) -> None:
    channel = _transport(transport_name).connect(endpoint, "bench", TIMEOUT)
    kind, size, repeats = job
    buffer = torch.ones(size if kind == "raw" else kv_bytes(size), dtype=torch.uint8)
    shape = (2, size, KV_HEADS, HEAD_DIM)
    payloads = [
        torch.randn(shape).to(torch.bfloat16) for _ in range(LAYERS if kind != "raw" else 0)
    ]
    frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    in_flight: deque = deque()
    for _ in range(repeats + 1):
        for tensor in (buffer,) if kind == "raw" else (buffer, frame, *payloads):
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
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--fresh-buffers", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for name in args.transports:
        rows.append(compare(name, args.prompt_len, args.rounds, args.fresh_buffers))
        print(f"{name}: {rows[-1]}", flush=True)
    megabytes = kv_bytes(args.prompt_len) / 1e6
    print(f"\nKV of a {args.prompt_len}-token prompt: {megabytes:.1f} MB; medians of {args.rounds}")
    print(f"{'transport':<10} {'raw GB/s':>9} {'layered GB/s':>13} {'layered/raw':>12}")
    for row in rows:
        ratio = row["layered_gbps"] / row["raw_gbps"]
        print(
            f"{row['transport']:<10} {row['raw_gbps']:>9.2f} {row['layered_gbps']:>13.2f} "
            f"{ratio:>11.0%}"
        )
    report = {"prompt_len": args.prompt_len, "rounds": args.rounds, "rows": rows}
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
