"""Layer pipelining is observable: layers are on the wire while later layers still compute."""

from __future__ import annotations

import time

import torch

from decode.worker import DecodeWorker
from engine.config import EngineConfig
from engine.engine import LLMEngine
from kvtransfer.transport import make_transport
from prefill.worker import PrefillReport, PrefillWorker
from protocol.messages import WorkRequest
from protocol.sampling import SamplingParams


def test_layer_sends_overlap_the_compute_of_later_layers(smollm2) -> None:
    config = EngineConfig(smollm2, num_kv_blocks=128, max_num_batched_tokens=1024)
    transport = make_transport("gloo", torch.device("cpu"))
    prefill = PrefillWorker("p-pipe", LLMEngine(config), transport, 30.0)
    decode = DecodeWorker("d-pipe", LLMEngine(config), transport, 30.0)
    try:
        prompt = [(31 * i) % 40000 + 100 for i in range(768)]
        request = WorkRequest("pipe", prompt, SamplingParams(max_tokens=2, temperature=0))
        ticket = decode.reserve(request, prefill.worker_id).result(30)
        outcome: dict[str, PrefillReport | Exception] = {}
        prefill.submit(request, ticket, lambda rid, out: outcome.__setitem__(rid, out))
        deadline = time.monotonic() + 120
        while "pipe" not in outcome:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        report = outcome["pipe"]
        assert isinstance(report, PrefillReport)
        result = report.trace
        num_layers = prefill.layout.num_layers
        assert [layer for layer, _ in result.layers_computed] == list(range(num_layers))
        last_layer_done = result.layers_computed[-1][1]
        sent_early = [layer for layer, start, _ in result.layers_sent if start < last_layer_done]
        # Most layers started moving before the prompt's last layer had even been computed.
        assert len(sent_early) >= num_layers // 2, (sent_early, result.layers_sent[:3])
        assert report.result.bytes_sent == ticket.num_bytes
    finally:
        prefill.shutdown()
        decode.shutdown()
