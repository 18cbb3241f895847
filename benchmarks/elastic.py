"""Elastic pools under load: how long a role switch, a join, a drain and the healing of a killed
worker take through a served tandem, and how many requests are lost or changed meanwhile.

    python benchmarks/elastic.py [--model DIR] [--rounds 5] [--concurrency 6] \
        [--output-len 48] [--json results/elastic.json]

One `tandem serve` (1 prefill + 2 decode workers) takes a steady greedy load (streamed
completions, token-id prompts, EOS ignored) from `--concurrency` clients. Each event happens
while the load runs:

    decode->prefill   POST /admin/workers/decode-1/role {"role": "prefill"}: its running
                      decodes move to decode-0 (re-prefilled from the tokens streamed so far)
    prefill->decode   the same worker back
    join              POST /admin/pools {"decode": 3}: until the new worker serves
    drain             POST /admin/workers/<new>/drain: until it has left
    kill -9           SIGKILL of one worker process: until it is out of routing (detected),
                      then until a replacement serves (healed)

Every request's text is compared with an undisturbed run of the same prompt: a request is lost
when its stream fails or comes up short, changed when its text differs. Switch times are the
server's own (from the moment the switch began until the worker is routable again in its new
role).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.serve_process import ServeProcess  # noqa: E402

START_TIMEOUT_S = 600
EVENT_TIMEOUT_S = 300
POLL_S = 0.05
TARGETS_MS = {"prefill->decode": 50, "decode->prefill": 300}


@dataclass
class Load:
    """Clients that loop over the prompts until stopped, checking every output."""

    url: str
    prompts: list[list[int]]
    output_len: int
    expected: dict[int, str] = field(default_factory=dict)
    done: int = 0
    lost: int = 0
    changed: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def one(self, http: httpx.AsyncClient, index: int) -> tuple[str, int] | None:
        """The streamed text and its token count, or None when the stream failed."""
        body = {
            "prompt": self.prompts[index], "max_tokens": self.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        text, count = "", 0
        try:
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    return None
                async for line in reply.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:  # the stream ended in an error event
                            self.errors.append(chunk["error"].get("message", ""))
                            return None
                        text += "".join(c["text"] for c in chunk["choices"])
                        count = (chunk.get("usage") or {}).get("completion_tokens", count)
        except httpx.HTTPError:
            return None
        return text, count

    async def client(self, http: httpx.AsyncClient, offset: int) -> None:
        index = offset
        while not self._stop.is_set():
            output = await self.one(http, index % len(self.prompts))
            self.record(index % len(self.prompts), output)
            index += 1

    def record(self, index: int, output: tuple[str, int] | None) -> None:
        self.done += 1
        if output is None or output[1] != self.output_len:
            self.lost += 1
        elif output[0] != self.expected.setdefault(index, output[0]):
            self.changed += 1

    async def run(self, concurrency: int) -> list[asyncio.Task]:
        http = httpx.AsyncClient(base_url=self.url, timeout=EVENT_TIMEOUT_S)
        return [asyncio.create_task(self.client(http, i)) for i in range(concurrency)]

    def stop(self) -> None:
        self._stop.set()


class Admin:
    def __init__(self, url: str) -> None:
        self.http = httpx.AsyncClient(base_url=url, timeout=EVENT_TIMEOUT_S)

    async def view(self) -> dict:
        reply = await self.http.get("/admin/pools")
        reply.raise_for_status()
        return reply.json()

    async def serving(self, pool: str) -> list[str]:
        workers = (await self.view())["workers"]
        return sorted(w["id"] for w in workers if w["pool"] == pool and w["state"] == "serving")

    async def post(self, path: str, body: dict | None = None) -> dict:
        reply = await self.http.post(path, json=body or {})
        if reply.status_code != 200:
            raise RuntimeError(f"{path}: {reply.status_code} {reply.text}")
        return reply.json()

    async def until(self, condition, what: str) -> float:
        start = time.monotonic()
        while not await condition():
            if time.monotonic() - start > EVENT_TIMEOUT_S:
                raise RuntimeError(f"{what} did not happen within {EVENT_TIMEOUT_S} s")
            await asyncio.sleep(POLL_S)
        return time.monotonic() - start


async def switch(admin: Admin, worker: str, role: str) -> float:
    return (await admin.post(f"/admin/workers/{worker}/role", {"role": role}))["switch_seconds"]


async def join_and_drain(admin: Admin) -> tuple[float, float]:
    before = await admin.serving("decode")
    started = time.monotonic()
    await admin.post("/admin/pools", {"decode": len(before) + 1})
    await admin.until(lambda: _count(admin, "decode", len(before) + 1), "join")
    joined = time.monotonic() - started
    (new,) = set(await admin.serving("decode")) - set(before)
    started = time.monotonic()
    await admin.post(f"/admin/workers/{new}/drain")
    await admin.until(lambda: _gone(admin, new), "drain")
    return joined, time.monotonic() - started


async def kill_one(admin: Admin) -> tuple[float, float]:
    """SIGKILL of a serving worker's process: (seconds until out of routing, until healed).
    Processes are tried newest first until one was a serving worker (a worker that has just
    left may still be exiting under the same title)."""
    sizes = {pool: len(await admin.serving(pool)) for pool in ("decode", "prefill")}
    everyone = set((await admin.serving("decode")) + (await admin.serving("prefill")))
    for pid in reversed(_worker_pids()):
        started = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while time.monotonic() - started < 10:
            if await _lost_one(admin, everyone):
                detected = time.monotonic() - started
                for pool, size in sizes.items():
                    await admin.until(lambda p=pool, n=size: _count(admin, p, n), "healing")
                return detected, time.monotonic() - started
            await asyncio.sleep(POLL_S)
    raise RuntimeError("no ray::WorkerActor process was a serving worker")


async def _count(admin: Admin, pool: str, size: int) -> bool:
    return len(await admin.serving(pool)) == size


async def _gone(admin: Admin, worker: str) -> bool:
    return all(w["id"] != worker for w in (await admin.view())["workers"])


async def _lost_one(admin: Admin, everyone: set[str]) -> bool:
    now = set((await admin.serving("decode")) + (await admin.serving("prefill")))
    return bool(everyone - now)


def _worker_pids() -> list[int]:
    """Processes whose title Ray set to ray::WorkerActor (this benchmark's server only runs)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "cmdline").read_bytes().startswith(b"ray::WorkerActor"):
                    pids.append(int(entry.name))
    return sorted(pids)


async def measure(url: str, args: argparse.Namespace) -> dict:
    prompts = [[(97 * i + 13 * j) % 20000 + 100 for j in range(48 + 16 * i)] for i in range(8)]
    load = Load(url, prompts, args.output_len)
    admin = Admin(url)
    # Undisturbed outputs first: every later output of the same prompt must equal them.
    async with httpx.AsyncClient(base_url=url, timeout=EVENT_TIMEOUT_S) as http:
        for i in range(len(prompts)):
            load.record(i, await load.one(http, i))
    tasks = await load.run(args.concurrency)
    await asyncio.sleep(2.0)  # the load reaches a steady state
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        times.setdefault("decode->prefill", []).append(await switch(admin, "decode-1", "prefill"))
        await asyncio.sleep(1.0)
        times.setdefault("prefill->decode", []).append(await switch(admin, "decode-1", "decode"))
        await asyncio.sleep(1.0)
    joined, drained = await join_and_drain(admin)
    times["join"], times["drain"] = [joined], [drained]
    if not args.skip_kill:
        detected, healed = await kill_one(admin)
        times["kill -9: detected"], times["kill -9: healed"] = [detected], [healed]
    await asyncio.sleep(2.0)
    load.stop()
    await asyncio.gather(*tasks)
    return {
        "times": times, "requests": load.done, "lost": load.lost, "changed": load.changed,
        "errors": sorted(set(load.errors)),
    }  # fmt: skip


def model_load_seconds(model: Path | None, dtype: str) -> float:
    """How long one worker's engine takes to load here (weights, packing, kernels), in this
    process: the yardstick for a join ("routable within its load time + 10 s")."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.fetch import fetch_default_model

    started = time.perf_counter()
    LLMEngine(EngineConfig(model or fetch_default_model(), dtype=dtype))
    return time.perf_counter() - started


def report(result: dict) -> str:
    lines = [f"{'event':<20} {'p50 ms':>9} {'max ms':>9} {'n':>3}  target"]
    result["times"]["model load (in-process)"] = [result["load_seconds"]]
    TARGETS_MS["join"] = round((result["load_seconds"] + 10) * 1e3)
    for event, seconds in result["times"].items():
        target = TARGETS_MS.get(event)
        verdict = "" if target is None else f"<= {target} ms p50"
        lines.append(
            f"{event:<20} {statistics.median(seconds) * 1e3:>9.1f} "
            f"{max(seconds) * 1e3:>9.1f} {len(seconds):>3}  {verdict}"
        )
    lines.append(
        f"requests: {result['requests']}, lost: {result['lost']}, changed: {result['changed']}"
    )
    lines += [f"error: {message}" for message in result["errors"]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model folder (default: the default model)")
    parser.add_argument("--rounds", type=int, default=5, help="role switches each way")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--skip-kill", action="store_true", help="leave out the kill -9 event")
    parser.add_argument(
        "--dtype", default="bfloat16", help="float32 makes a moved request's recomputed KV "
        "bit-equal to what it replaces, so 'changed' counts only real losses",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    serve_args = ["--prefill-workers", "1", "--decode-workers", "2", "--log-level", "warning"]
    serve_args += ["--dtype", args.dtype]
    if args.model is not None:
        serve_args += ["--model", str(args.model)]
    with (
        tempfile.TemporaryDirectory() as tmp,
        ServeProcess(serve_args, Path(tmp) / "serve.log") as server,
    ):
        server.wait_healthy(START_TIMEOUT_S)
        result = asyncio.run(measure(server.url, args))
        server.stop(60)
    result["load_seconds"] = model_load_seconds(args.model, args.dtype)
    print(report(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["lost"] == result["changed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
