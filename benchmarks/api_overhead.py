"""The HTTP layer's CPU per streamed token: tandem's own app (FastAPI, admission, metrics, SSE
framing) over a backend that costs nothing, with `tandem bench`'s client streaming from it.

    python benchmarks/api_overhead.py [--concurrency 64] [--num-prompts 384] [--output-len 128] \
        [--tick-ms 20] [--rounds 3] [--json results/api_overhead.json]

The backend gives every running request one token each `--tick-ms` (one shared timer, as decode
steps would), so the serving process spends what the API costs and nothing else. Reported per
streamed token: the serving process's user and system CPU (from /proc), the client's (its
rusage), and the most tokens a second one serving process could stream at that cost
(1e6 / its us per token). On a GPU, where an engine step takes milliseconds for hundreds of
streams, that ceiling is what the HTTP layer leaves the engine; on a 2-core CPU host the same
microseconds are taken from the engine's cores.

The serving process runs uvicorn as `tandem serve` does (uvloop and httptools, which uvicorn
picks when installed); the client is `tandem bench` (random prompts of --input-len words,
ignore-eos, greedy). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.outputs import RequestOutput, read_stream  # noqa: E402
from loadtest.serve_process import free_port  # noqa: E402

START_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 600.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class FreeBackend:
    """An EngineClient (coordinator/api/client.py) whose tokens cost nothing: each running
    request gets token `1000 + i % 500` (text " w<i>") at every tick until its max_tokens."""

    def __init__(self, tokenizer_dir: Path, tick_s: float) -> None:
        from engine.tokenizer import Tokenizer

        self.model_name = "free"
        self.tokenizer = Tokenizer(tokenizer_dir)
        self.max_model_len = 1 << 16
        self.tick_s = tick_s
        self._running: dict[str, tuple[asyncio.Queue, list[int], int, list[int]]] = {}

    def check_request(self, prompt_ids: list[int], params=None) -> None:
        pass

    async def generate(self, prompt_ids: list[int], params, request_id: str):
        queue: asyncio.Queue = asyncio.Queue()
        self._running[request_id] = (queue, [], params.max_tokens, prompt_ids)
        try:
            async for output in read_stream(queue):
                yield output
        finally:
            self._running.pop(request_id, None)

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:  # on a fixed period, as long as a tick's work takes less than one
            due = max(due + self.tick_s, loop.time())
            await asyncio.sleep(due - loop.time())
            for request_id, (queue, tokens, max_tokens, prompt_ids) in list(self._running.items()):
                i = len(tokens)
                tokens.append(1000 + i % 500)
                queue.put_nowait(
                    RequestOutput(
                        request_id, prompt_ids, token_ids=list(tokens), delta_token_ids=tokens[-1:],
                        delta_text=f" w{i}",
                        finish_reason="length" if len(tokens) >= max_tokens else None,
                    )
                )  # fmt: skip

    async def ready(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    def stats(self) -> list:
        return []

    def pools(self) -> list:
        return []

    def recent_steps(self, worker_id, limit) -> dict:
        return {}

    def readiness(self) -> str | None:
        return None

    async def shutdown(self) -> None:
        self._ticker.cancel()


def serve(port: int, tokenizer_dir: Path, tick_s: float) -> None:
    """The serving process: the app over FreeBackend on 127.0.0.1:`port`."""
    import uvicorn

    from coordinator.api.app import create_app

    app = create_app(FreeBackend(tokenizer_dir, tick_s))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")


def process_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def wait_healthy(url: str, server: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the serving process exited with {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the serving process did not answer within {START_TIMEOUT_S:g} s")


def bench(url: str, args: argparse.Namespace, num_prompts: int, result: Path) -> dict:
    """One `tandem bench` run; its result JSON, with the client's CPU seconds added."""
    command = [
        sys.executable, "-m", "cli.main", "bench", "--base-url", url, "--model", "free",
        "--tokenizer", str(args.tokenizer), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(args.concurrency),
        "--ignore-eos", "--temperature", "0", "--save-result",
        "--result-dir", str(result.parent), "--result-filename", result.name,
        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    client = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        _, status, usage = os.wait4(client.pid, 0)
    except BaseException:
        client.kill()
        raise
    output = client.stdout.read() if client.stdout else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"tandem bench failed:\n{output}")
    record = json.loads(result.read_text())
    record["client_cpu_s"] = usage.ru_utime + usage.ru_stime
    return record


def measure(url: str, server_pid: int, args: argparse.Namespace, work: Path) -> dict:
    """One round: a warm-up run of one request per stream, then the measured run. The client's
    cost per token is the difference of the two runs' CPU over the difference of their tokens,
    so that its start-up (tokenizer, prompts) drops out."""
    warmup = bench(url, args, args.concurrency, work / "warmup.json")
    before = process_cpu(server_pid)
    started = time.monotonic()
    record = bench(url, args, args.num_prompts, work / "run.json")
    wall = time.monotonic() - started
    after = process_cpu(server_pid)
    tokens = record["total_output_tokens"]
    if tokens != args.num_prompts * args.output_len:
        raise SystemExit(f"expected {args.num_prompts * args.output_len} tokens, got {tokens}")
    user, system = (after[i] - before[i] for i in range(2))
    client_s = record["client_cpu_s"] - warmup["client_cpu_s"]
    return {
        "tokens": tokens,
        "output_tok_s": record["output_throughput"],
        "server_user_us": user / tokens * 1e6,
        "server_sys_us": system / tokens * 1e6,
        "server_us": (user + system) / tokens * 1e6,
        "server_cores": (user + system) / wall,
        "client_us": client_s / (tokens - warmup["total_output_tokens"]) * 1e6,
        "ceiling_tok_s": tokens / (user + system) if user + system else None,
        "itl_p50_ms": record.get("p50_itl_ms"),
        "itl_p99_ms": record.get("p99_itl_ms"),
    }


def summarize(rounds: list[dict]) -> dict:
    keys = [k for k in rounds[0] if isinstance(rounds[0][k], int | float)]
    return {k: statistics.median(r[k] for r in rounds if r[k] is not None) for k in keys}


def table(summary: dict, args: argparse.Namespace) -> str:
    return "\n".join([
        f"{'streams':>7} | {'tick ms':>7} | {'tok/s':>7} | {'server us/tok (user+sys)':>24} | "
        f"{'ceiling tok/s':>13} | {'client us/tok':>13} | {'ITL p50/p99 ms':>14}",
        f"{args.concurrency:>7} | {args.tick_ms:>7g} | {summary['output_tok_s']:>7.0f} | "
        f"{summary['server_us']:>9.1f} ({summary['server_user_us']:.1f}+"
        f"{summary['server_sys_us']:.1f}) | {summary['ceiling_tok_s']:>13,.0f} | "
        f"{summary['client_us']:>13.1f} | "
        f"{summary['itl_p50_ms']:>6.1f}/{summary['itl_p99_ms']:.1f}",
        f"(medians of {args.rounds} rounds; ceiling: 1e6 / server us per token)",
    ])  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=384, help="per round")
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--tick-ms", type=float, default=20.0, help="the backend's step time")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=0, help="0: a free one")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a folder with tokenizer files (default: SmolLM2-135M-Instruct's, "
                        "fetched as benchmarks/serving.py does)")  # fmt: skip
    p.add_argument("--json", type=Path)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tokenizer is None:
        from engine.fetch import fetch_default_model

        args.tokenizer = fetch_default_model()
    if args.serve:
        serve(args.port, args.tokenizer, args.tick_ms / 1000)
        return 0
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    child = [sys.executable, __file__, "--serve", "--port", str(port),
             "--tick-ms", str(args.tick_ms), "--tokenizer", str(args.tokenizer)]  # fmt: skip
    server = subprocess.Popen(child, cwd=ROOT)
    try:
        wait_healthy(url, server)
        with tempfile.TemporaryDirectory() as work:
            rounds = []
            for i in range(args.rounds):
                rounds.append(measure(url, server.pid, args, Path(work)))
                done = rounds[-1]
                print(f"[round {i + 1}/{args.rounds}] {done['output_tok_s']:.0f} tok/s, "
                      f"server {done['server_us']:.1f} us/token", file=sys.stderr)  # fmt: skip
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
    summary = summarize(rounds)
    print(table(summary, args))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"settings": {k: str(v) if isinstance(v, Path) else v
                               for k, v in vars(args).items()},
                  "summary": summary, "rounds": rounds}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
