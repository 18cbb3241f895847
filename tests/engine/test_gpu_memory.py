"""`--gpu-memory-utilization`: the KV pool gets what weights and a step's activations leave of
the engine's share of the GPU, and never more than is free."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.gpu_memory import RUNTIME_RESERVE_BYTES, activation_bytes, kv_budget, weight_bytes
from engine.kv_cache import bytes_per_block

GIB = 1 << 30


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_weight_bytes_count_every_checkpoint_parameter(checkpoints, family: str) -> None:
    folder = checkpoints(family)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    params = sum(p.numel() for p in hf.parameters())  # tied embeddings once, as ours
    cfg = ModelConfig.from_pretrained(folder)
    assert weight_bytes(cfg, torch.bfloat16) == 2 * params


def fake_gpu(monkeypatch, free: int, total: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")


def test_the_pool_gets_the_share_less_weights_activations_and_reserve(
    checkpoints, monkeypatch
) -> None:
    folder = checkpoints("llama")
    cfg = ModelConfig.from_pretrained(folder)
    engine = EngineConfig(model=folder, device="cuda", gpu_memory_utilization=0.5)
    fake_gpu(monkeypatch, free=80 * GIB, total=80 * GIB)
    spent = weight_bytes(cfg, torch.bfloat16) + activation_bytes(cfg, engine)
    assert kv_budget(cfg, engine) == 40 * GIB - spent - RUNTIME_RESERVE_BYTES
    # another worker holds 60 GiB: only what is free counts
    fake_gpu(monkeypatch, free=20 * GIB, total=80 * GIB)
    assert kv_budget(cfg, engine) == 20 * GIB - spent - RUNTIME_RESERVE_BYTES


def test_no_room_for_one_block_is_a_config_error(checkpoints, monkeypatch) -> None:
    folder = checkpoints("llama")
    cfg = ModelConfig.from_pretrained(folder)
    engine = EngineConfig(model=folder, device="cuda", gpu_memory_utilization=0.01)
    fake_gpu(monkeypatch, free=80 * GIB, total=80 * GIB)
    with pytest.raises(ConfigError, match="leaves no room for the KV cache on Fake GPU"):
        kv_budget(cfg, engine)


def test_activations_grow_with_the_step_budget(checkpoints) -> None:
    folder = checkpoints("llama")
    cfg = ModelConfig.from_pretrained(folder)
    small = EngineConfig(model=folder, device="cuda", max_num_batched_tokens=256)
    large = EngineConfig(model=folder, device="cuda", max_num_batched_tokens=4096)
    assert activation_bytes(cfg, large) > 8 * activation_bytes(cfg, small)
    # the scored prompt tokens' float32 logits alone
    assert activation_bytes(cfg, large) > 4096 * cfg.vocab_size * 4


@pytest.mark.parametrize("share", [0.0, 1.5, -0.1])
def test_a_share_outside_zero_to_one_is_refused(share: float) -> None:
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(model="m", gpu_memory_utilization=share)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_engine_takes_its_share_and_stays_within_it(checkpoints) -> None:
    from engine.llm import LLM
    from protocol.sampling import SamplingParams

    folder = checkpoints("llama")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_reserved()  # earlier tests' tensors still alive in this process
    free, total = torch.cuda.mem_get_info()
    llm = LLM(folder, device="cuda", gpu_memory_utilization=0.2)
    cfg, config = llm.engine.model_config, llm.engine.config
    expected = min(int(0.2 * total), free) - RUNTIME_RESERVE_BYTES
    expected -= weight_bytes(cfg, torch.bfloat16) + activation_bytes(cfg, config)
    per_block = bytes_per_block(cfg, config.block_size, torch.bfloat16)
    assert llm.engine.num_blocks == expected // per_block
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm.generate_ids([[5, 6, 7, 8]] * 8, params)
    assert torch.cuda.max_memory_reserved() - held <= 0.2 * total
