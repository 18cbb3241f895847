"""The KV threads' own CUDA streams.

A sender or receiver thread that copied, summed or unpacked a payload on the compute thread's
stream would wait, at every host sync (a checksum read, a copy to host memory), behind whatever
the engine had queued there since: the prefill's next layers, the decode step in flight; and an
NCCL send ordered after the compute stream would leave only after those layers. On its own
stream a thread waits only for its payload. (On one H200, 1P1D over gloo read the same TTFT with
and without this, 410-470 ms at 16 streams: what bounds it there is elsewhere; docs/performance.md.)
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()


def use_own_stream(device: torch.device) -> None:
    """From now on this thread's current stream on `device` (CUDA) is one of its own, made at
    its first call. Nothing elsewhere. For threads that do nothing but KV transfer."""
    if device.type != "cuda":
        return
    owned = _local.__dict__.setdefault("streams", {})
    if device not in owned:
        owned[device] = torch.cuda.Stream(device)
        torch.cuda.set_stream(owned[device])


def adopt(payload: torch.Tensor, ready: torch.cuda.Event | None) -> None:
    """Orders this thread's stream after `ready` (the event recorded after `payload` was
    packed on another stream) and keeps `payload`'s memory from reuse until this stream's
    work on it is done. Nothing on CPU."""
    if payload.device.type != "cuda":
        return
    stream = torch.cuda.current_stream(payload.device)
    if ready is not None:
        stream.wait_event(ready)
    payload.record_stream(stream)


def settle(device: torch.device) -> None:
    """Waits for this thread's stream on `device` (CUDA): what it queued has happened."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
