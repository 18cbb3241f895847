"""Tensor parallelism inside one engine: the split, the per-rank weight slices, and greedy output
at TP 2 and 4 equal to TP 1 (followers as local processes; tests/disagg covers Ray ranks)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from engine.config import ConfigError, ModelConfig
from engine.llm import LLM
from engine.model import CausalLM
from engine.parallel import Collectives, shard_for
from engine.weights import load_weights
from protocol.sampling import SamplingParams
from tests.support.prompts import mixed_prompts

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def wide_llama(checkpoints):
    """8 attention heads over 4 KV heads (head_dim 8)."""
    return checkpoints("llama", num_attention_heads=8, num_key_value_heads=4)


def model_config(**fields) -> ModelConfig:
    base = dict(
        path=".", architecture="LlamaForCausalLM", vocab_size=384, hidden_size=64,
        intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_position_embeddings=512,
        tie_word_embeddings=False, qkv_bias=False, qk_norm=False, eos_token_ids=(),
        bos_token_id=None, max_model_len=512,
    )  # fmt: skip
    return ModelConfig(**{**base, **fields})


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "expected"),
    [
        # (query heads, KV heads, first KV head) per rank
        (4, 2, 2, [(2, 1, 0), (2, 1, 1)]),
        (4, 2, 4, [(1, 1, 0), (1, 1, 0), (1, 1, 1), (1, 1, 1)]),  # KV heads replicated
        (8, 4, 2, [(4, 2, 0), (4, 2, 2)]),
        (9, 3, 3, [(3, 1, 0), (3, 1, 1), (3, 1, 2)]),  # SmolLM2-135M
    ],
)
def test_heads_split_across_ranks(heads, kv_heads, size, expected) -> None:
    cfg = model_config(num_heads=heads, num_kv_heads=kv_heads, intermediate_size=1536)
    shards = [shard_for(cfg, size, rank) for rank in range(size)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start) for s in shards] == expected
    assert {s.intermediate_size for s in shards} == {1536 // size}
    assert sum(s.vocab_rows for s in shards) >= 384


@pytest.mark.parametrize(
    ("fields", "size", "message"),
    [
        ({"num_heads": 9, "num_kv_heads": 3}, 2, "9 attention heads"),
        ({"num_heads": 8, "num_kv_heads": 4}, 3, "8 attention heads"),
        ({"num_heads": 6, "num_kv_heads": 4}, 6, "4 KV heads"),
        ({"intermediate_size": 100}, 8, "MLP width 100"),
    ],
)
def test_a_split_that_does_not_divide_is_a_config_error(fields, size, message) -> None:
    with pytest.raises(ConfigError, match=message):
        shard_for(model_config(**fields), size, 0)


class NoGroup:
    """Loading runs no collective; a model built for a test needs no process group."""


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_reads_only_its_slices(tiny_llama, size) -> None:
    cfg = ModelConfig.from_pretrained(tiny_llama)
    full = load_file(str(tiny_llama / "model.safetensors"))
    hd = cfg.head_dim
    for rank in range(size):
        shard = shard_for(cfg, size, rank)
        with torch.device("meta"):
            model = CausalLM(cfg, shard, Collectives(size, NoGroup()))
        model = model.to_empty(device="cpu")
        load_weights(model, tiny_llama)
        params = dict(model.named_parameters())
        q = slice(rank * shard.num_heads * hd, (rank + 1) * shard.num_heads * hd)
        kv = slice(shard.kv_head_start * hd, (shard.kv_head_start + shard.num_kv_heads) * hd)
        attn = "model.layers.1.self_attn."
        expected_qkv = torch.cat(
            [full[attn + "q_proj.weight"][q], full[attn + "k_proj.weight"][kv],
             full[attn + "v_proj.weight"][kv]]
        )  # fmt: skip
        assert torch.equal(params["layers.1.attn.qkv_proj.weight"], expected_qkv)
        assert torch.equal(
            params["layers.1.attn.o_proj.weight"], full[attn + "o_proj.weight"][:, q]
        )
        mlp = slice(rank * shard.intermediate_size, (rank + 1) * shard.intermediate_size)
        down = full["model.layers.1.mlp.down_proj.weight"][:, mlp]
        assert torch.equal(params["layers.1.down_proj.weight"], down)
        rows = slice(shard.vocab_start, shard.vocab_start + shard.vocab_rows)
        assert torch.equal(params["lm_head.weight"], full["lm_head.weight"][rows])
        # This rank holds 1/size of every split matrix: no rank holds the whole model.
        assert params["layers.1.gate_up_proj.weight"].shape == (
            2 * cfg.intermediate_size // size,
            64,
        )


def generate(folder, prompts, size: int, dtype: str = "float32") -> list[list[int]]:
    llm = LLM(folder, dtype=dtype, block_size=4, tensor_parallel_size=size)
    try:
        return [out.token_ids for out in llm.generate_ids(prompts, GREEDY)]
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("model", "size"),
    [("tiny_llama", 2), ("tiny_llama", 4), ("wide_llama", 2)],
    ids=["4-heads-2-kv-tp2", "4-heads-2-kv-tp4-replicated-kv", "8-heads-4-kv-tp2"],
)
def test_greedy_output_at_tp_n_equals_tp_1(request, model, size) -> None:
    folder = request.getfixturevalue(model)
    prompts = mixed_prompts(384, count=5, seed=11)
    # Alone and batched, and a prompt sharing a prefix (a prefix-cache hit on every rank).
    prompts.append(prompts[0][:12] + prompts[1][:5])
    assert generate(folder, prompts, size) == generate(folder, prompts, 1)


def test_a_dead_rank_fails_the_step_instead_of_hanging(tiny_llama) -> None:
    llm = LLM(tiny_llama, dtype="float32", block_size=4, tensor_parallel_size=2, rank_timeout=30)
    try:
        (follower,) = [p for p in multiprocessing.active_children() if p.name == "tandem-rank-1"]
        assert llm.generate_ids([[5, 6, 7]], GREEDY)[0].token_ids  # serving before the kill
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(10)
        started = time.monotonic()
        with pytest.raises((RuntimeError, OSError)):
            llm.generate_ids([[5, 6, 7, 8]], GREEDY)
        assert time.monotonic() - started < 30
    finally:
        llm.close()
