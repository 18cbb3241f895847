"""Decode steps padded to graph buckets (engine/cuda_graphs.py): the buckets, which steps a
graph holds, and that padding rows change no real row's tokens. On the CPU the padded steps
run eagerly (capture=False); the `gpu` test captures and replays real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from engine.cuda_graphs import batch_buckets, context_buckets
from engine.llm import LLM
from protocol.sampling import SamplingParams
from tests.support.prompts import mixed_prompts

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def test_batch_buckets_cover_every_size_up_to_the_maximum() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert batch_buckets(300)[-4:] == [240, 256, 288, 300]


def test_context_buckets_stop_at_the_longest_context() -> None:
    assert context_buckets(100_000) == [512, 2048, 8192]
    assert context_buckets(8192) == [512, 2048, 8192]
    assert context_buckets(1000) == [512, 1000]
    assert context_buckets(300) == [300]


def padded_llm(folder, **options) -> tuple[LLM, list[int]]:
    """An LLM whose decode steps go through the graph buckets without capture; returns it and
    the list of (rows, width) every padded step ran at."""
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=128, **options)
    engine = llm.engine
    runner = engine.runner
    graphs = runner.decode_graphs(engine.model_config, engine.config, engine.num_blocks, False)
    runs: list[int] = []
    original = graphs.run

    def run(input_ids, *rest):
        runs.append(len(input_ids))
        return original(input_ids, *rest)

    graphs.run = run
    runner.graphs = graphs
    return llm, runs


def test_padded_decode_steps_give_the_eager_tokens(tiny_llama) -> None:
    vocab = LLM(tiny_llama, dtype="float32").engine.model_config.vocab_size
    prompts = mixed_prompts(vocab, count=7, seed=3)
    eager = LLM(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=128)
    expected = [out.token_ids for out in eager.generate_ids(prompts, GREEDY)]
    llm, runs = padded_llm(tiny_llama)
    assert [out.token_ids for out in llm.generate_ids(prompts, GREEDY)] == expected
    assert 7 in runs  # 7 rows padded to 8 ...
    alone = [llm.generate_ids([p], GREEDY)[0].token_ids for p in prompts[:3]]
    assert alone == expected[:3]  # ... and 1 row in a bucket of its own
    assert 1 in runs
    # every block went back: the padding block was never one of them
    assert llm.engine.blocks.num_free_blocks == llm.engine.num_blocks


def test_padding_rows_write_only_the_padding_block(tiny_llama) -> None:
    llm, runs = padded_llm(tiny_llama)
    vocab = llm.engine.model_config.vocab_size
    graphs = llm.engine.runner.graphs
    before = [(k.clone(), v.clone()) for k, v in llm.engine.runner.kv_caches]
    # three real rows at blocks 5, 6, 7 (first slot of each, context 1), padded to 4 rows
    graphs.run([vocab - 1] * 3, [0] * 3, [20, 24, 28], [[5], [6], [7]], [1] * 3)
    pad = llm.engine.num_blocks
    for (k0, v0), (k1, v1) in zip(before, llm.engine.runner.kv_caches, strict=True):
        changed = ((k0 != k1) | (v0 != v1)).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert changed == [5, 6, 7, pad]


def test_only_decode_steps_a_bucket_holds_are_padded(tiny_llama) -> None:
    llm, _ = padded_llm(tiny_llama, max_num_seqs=8, max_model_len=64)
    graphs = llm.engine.runner.graphs
    assert graphs.batches == [1, 2, 4, 8] and graphs.widths == [16]  # 64 tokens of 4
    assert graphs.fits(3, [[1], [2, 3], [4]], has_prefills=False)
    assert not graphs.fits(3, [[1], [2], [3]], has_prefills=True)  # prefill chunks: eager
    assert not graphs.fits(9, [[1]] * 9, has_prefills=False)  # more rows than any bucket
    assert not graphs.fits(1, [list(range(17))], has_prefills=False)  # context too long


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_give_the_eager_tokens(tiny_llama) -> None:
    """Captured graphs against eager steps on the same GPU: the same greedy tokens, batched
    and alone (the eager engine's against transformers: test_model_parity)."""
    vocab = LLM(tiny_llama, dtype="float32").engine.model_config.vocab_size
    prompts = mixed_prompts(vocab, count=7, seed=3)
    options = {"dtype": "float32", "device": "cuda", "block_size": 16, "max_num_seqs": 16}
    eager = LLM(tiny_llama, cuda_graphs=False, **options)
    graphs = LLM(tiny_llama, **options)
    assert graphs.engine.runner.graphs is not None and graphs.engine.runner.graphs.graphs
    expected = [out.token_ids for out in eager.generate_ids(prompts, GREEDY)]
    assert [out.token_ids for out in graphs.generate_ids(prompts, GREEDY)] == expected
    assert [graphs.generate_ids([p], GREEDY)[0].token_ids for p in prompts[:2]] == expected[:2]


def test_a_one_token_prompt_chunk_among_decodes_lends_no_decode_its_logits(tiny_llama) -> None:
    """At a budget of 2, a prompt prefilled here ahead of a request whose KV arrived (a decode
    worker's batch) computes 1 token a step beside its decode: a step of 1-token rows a
    bucket holds, one of which samples nothing."""

    def decoded(llm: LLM) -> list[int]:
        engine = llm.engine
        engine.add_request("local", list(range(5, 15)), GREEDY)
        engine.step()  # its first 2 tokens
        engine.reserve("remote", [20, 21, 22], GREEDY)
        engine.admit("remote", 23)
        tokens = []
        for _ in range(4):  # local: 1 prompt token a step; remote: 1 decode
            tokens += [u.token_ids[0] for u in engine.step() if u.request_id == "remote"]
        return tokens

    options = {"max_num_seqs": 2, "max_num_batched_tokens": 2}
    eager = LLM(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=128, **options)
    llm, runs = padded_llm(tiny_llama, **options)
    assert decoded(llm) == decoded(eager)
    assert runs == []  # a row that samples nothing: no bucket's logits are the step's
