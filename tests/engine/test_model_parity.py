"""Tiny random Llama / Qwen2 / Qwen3 / Mistral: logits and 32 greedy tokens against transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.llm import LLM
from protocol.sampling import SamplingParams
from tests.support.hf_reference import hf_greedy

PROMPTS = [
    "The quick brown fox",
    "Paged attention stores keys and values in fixed-size blocks.",
    "日本語 😀",
]
# min_tokens masks EOS exactly as min_new_tokens does on the transformers side.
GREEDY_32 = SamplingParams(max_tokens=32, min_tokens=32, temperature=0)
FAMILIES = [
    ("llama", {}),
    (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    ("qwen2", {}),
    ("qwen3", {}),
    ("mistral", {"sliding_window": None}),
]


@pytest.mark.parametrize(("family", "overrides"), FAMILIES, ids=lambda v: str(v)[:20])
def test_greedy_tokens_match_transformers(checkpoints, family: str, overrides: dict) -> None:
    folder = checkpoints(family, **overrides)
    llm = LLM(folder, dtype="float32")
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    ours = llm.generate_ids(prompts, GREEDY_32)
    for prompt_ids, output in zip(prompts, ours, strict=True):
        assert output.token_ids == hf_greedy(folder, prompt_ids, 32)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_prefill_logits_close_to_transformers(checkpoints, family: str) -> None:
    folder = checkpoints(family)
    llm = LLM(folder, dtype="float32")
    prompt_ids = llm.tokenizer.encode(PROMPTS[1])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = model(torch.tensor([prompt_ids])).logits[0, -1]
    captured = []
    original = llm.engine.runner.model.forward

    def spy(batch, kv_caches, on_layer=None):
        logits = original(batch, kv_caches, on_layer)
        captured.append(logits)
        return logits

    llm.engine.runner.model.forward = spy
    llm.generate_ids([prompt_ids], SamplingParams(max_tokens=1, temperature=0))
    torch.testing.assert_close(captured[0][0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_on_cuda_match_transformers(checkpoints, family: str) -> None:
    """The engine on a GPU (Triton kernels, float32 exact dots) against transformers on the CPU:
    the same 32 tokens, each prompt alone and all three batched."""
    folder = checkpoints(family)
    llm = LLM(folder, dtype="float32", device="cuda")
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(folder, ids, 32) for ids in prompts]
    batched = [out.token_ids for out in llm.generate_ids(prompts, GREEDY_32)]
    alone = [llm.generate_ids([ids], GREEDY_32)[0].token_ids for ids in prompts]
    assert batched == expected
    assert alone == expected
