"""How much of a GPU's memory an engine's KV pool may take under `--gpu-memory-utilization`.

The engine may hold `utilization` of the device's memory in all: its weights, the activations
of its largest step, and its KV pool, which gets what the first two leave. Weights are counted
exactly (the model built on the meta device); a step's activations are estimated from its
token budget, as the tensors one layer holds at once at their widest, with the logits of every
sampled row and of a whole chunk of scored prompt tokens (prompt logprobs) in float32, and a
fixed reserve for CUDA graphs, cuBLAS workspaces and the allocator's rounding.
"""

from __future__ import annotations

import torch

from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.kv_cache import bytes_per_block
from engine.model import CausalLM
from engine.parallel import TPShard, single

RUNTIME_RESERVE_BYTES = 1 << 30  # graphs' memory pools, cuBLAS workspaces, allocator slack
FLOAT32_BYTES = 4


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, shard: TPShard | None = None) -> int:
    """Bytes of one rank's parameters at `dtype`."""
    with torch.device("meta"):
        model = CausalLM(cfg, shard)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def activation_bytes(cfg: ModelConfig, engine: EngineConfig, shard: TPShard | None = None) -> int:
    """An upper estimate of one step's live activations: the budget's tokens through the
    widest layer tensors, plus float32 logits for sampled rows and scored prompt tokens."""
    shard = shard or single(cfg)
    itemsize = getattr(torch, engine.dtype).itemsize
    tokens = engine.max_num_batched_tokens or engine.max_num_seqs
    qkv = (shard.num_heads + 2 * shard.num_kv_heads) * cfg.head_dim
    mlp = 3 * shard.intermediate_size  # gate_up and the activation beside it
    per_token = (max(qkv, mlp) + 4 * cfg.hidden_size) * itemsize
    logits = (engine.max_num_seqs + tokens) * cfg.vocab_size * FLOAT32_BYTES * 2
    return tokens * per_token + logits


def kv_budget(cfg: ModelConfig, engine: EngineConfig, shard: TPShard | None = None) -> int:
    """The KV pool's bytes on this rank's GPU; ConfigError when not one block fits."""
    share = engine.gpu_memory_utilization
    assert share is not None
    device = torch.device(engine.device)
    free, total = torch.cuda.mem_get_info(device)
    dtype = getattr(torch, engine.dtype)
    weights = weight_bytes(cfg, dtype, shard)
    activations = activation_bytes(cfg, engine, shard)
    # Never more than is free now: another process (a second worker) may hold the rest.
    allowed = min(int(share * total), free)
    budget = allowed - weights - activations - RUNTIME_RESERVE_BYTES
    if budget < bytes_per_block(cfg, engine.block_size, dtype, shard):
        gib = 2**30
        raise ConfigError(
            f"--gpu-memory-utilization {share} leaves no room for the KV cache on "
            f"{torch.cuda.get_device_name(device)}: {share * total / gib:.1f} GiB allowed, "
            f"{free / gib:.1f} GiB free, weights {weights / gib:.1f} GiB, activations "
            f"~{activations / gib:.1f} GiB, reserve {RUNTIME_RESERVE_BYTES / gib:.0f} GiB"
        )
    return budget
