"""Structured output (engine/structured.py): every token sampled under a response format keeps
the output inside it, the output ends when the format is complete, a decode worker's matcher
picks up the tokens sampled elsewhere, and a format that cannot be used fails its request
alone."""

from __future__ import annotations

import json
import threading
import time

import pytest
from transformers import AutoTokenizer

from engine import structured
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.llm import LLM
from engine.structured import Structures
from protocol.messages import RequestFailed
from protocol.sampling import SamplingParams

pytest.importorskip("xgrammar")

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=256)


def run(llm: LLM, structure, **options) -> tuple[str, str]:
    params = SamplingParams(max_tokens=40, temperature=0, structure=structure, **options)
    out = llm.generate_ids([PROMPT], params)[0]
    return out.text, out.finish_reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_regex_holds_the_output_and_ends_it(llm, temperature) -> None:
    for seed in range(3):
        params = SamplingParams(
            max_tokens=40, temperature=temperature, seed=seed, structure=("regex", "(yes|no)!")
        )
        out = llm.generate_ids([PROMPT], params)[0]
        assert out.text in ("yes!", "no!") and out.finish_reason == "stop", out.text


def test_a_json_schema_holds_the_output(llm) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
              "n": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["ok", "n"],
              "additionalProperties": False}  # fmt: skip
    text, finish = run(llm, ("json_schema", json.dumps(schema)))
    assert finish == "stop", text
    value = json.loads(text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)


def test_ignore_eos_still_ends_when_the_format_is_complete(llm) -> None:
    text, finish = run(llm, ("regex", "(ab|cd)"), ignore_eos=True)
    assert text in ("ab", "cd") and finish == "stop"


def test_unstructured_requests_beside_a_structured_one_are_unchanged(llm) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate_ids([PROMPT], plain)[0].token_ids
    mixed = llm.generate_ids(
        [PROMPT, PROMPT], [plain, SamplingParams(max_tokens=12, structure=("regex", "x+"))]
    )
    assert mixed[0].token_ids == alone
    assert set(mixed[1].text) == {"x"}


def test_a_matcher_made_late_reads_the_tokens_sampled_elsewhere(tiny_llama) -> None:
    """A decode worker takes over after the prefill worker (or a lost attempt) sampled some
    tokens: its engine gets them as output_ids and continues inside the format."""
    spec = ("regex", "(abc|abd)e+")
    whole = LLM(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=256)
    full = whole.generate_ids([PROMPT], SamplingParams(max_tokens=20, temperature=0,
                                                       structure=spec))[0]  # fmt: skip
    assert full.text.startswith(("abc", "abd"))
    engine = LLMEngine(EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=256))
    params = SamplingParams(max_tokens=20, temperature=0, structure=spec)
    engine.add_request("r", PROMPT, params, output_ids=full.token_ids[:2])
    tokens = list(full.token_ids[:2])
    for _ in range(40):
        for update in engine.step():
            tokens.extend(update.token_ids)
        if not engine.has_unfinished:
            break
    assert tokens == list(full.token_ids)


def steps_to_the_end(engine: LLMEngine, seconds: float = 60.0) -> list:
    """Every update until the engine has nothing left (grammars compile on their own thread)."""
    updates, deadline = [], time.monotonic() + seconds
    while engine.has_unfinished:
        assert time.monotonic() < deadline, "the engine never finished"
        updates += engine.step()
    return updates


def beside_a_good_one(tiny_llama, bad: SamplingParams) -> tuple[LLMEngine, list]:
    """Request "bad" with `bad`, "good" (3 greedy tokens) beside it: every update."""
    engine = LLMEngine(EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=256))
    engine.add_request("bad", PROMPT, bad)
    engine.add_request("good", PROMPT, SamplingParams(max_tokens=3, temperature=0))
    return engine, steps_to_the_end(engine)


@pytest.fixture
def held_compiles(monkeypatch) -> threading.Event:
    """Grammar compiles wait until the returned event is set (set again at the test's end, so
    the compile thread is never left waiting)."""
    release = threading.Event()
    real = Structures._compile_now

    def held(self, spec):
        release.wait(60)
        return real(self, spec)

    monkeypatch.setattr(Structures, "_compile_now", held)
    yield release
    release.set()


def test_a_slow_compile_holds_up_its_own_request_only(llm, tiny_llama, held_compiles) -> None:
    """The grammar compiles off the engine thread: the request beside it runs to its end
    meanwhile, and the structured one starts once its grammar is ready, with the output it
    has without the wait."""
    structured_params = SamplingParams(max_tokens=9, temperature=0, structure=("regex", "ab+"))
    held_compiles.set()
    expected = llm.generate_ids([PROMPT], structured_params)[0].token_ids
    held_compiles.clear()
    engine = LLMEngine(EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=256))
    engine.add_request("slow", PROMPT, structured_params)
    engine.add_request("good", PROMPT, SamplingParams(max_tokens=3, temperature=0))
    updates = []
    for _ in range(20):
        updates += engine.step()
    assert sum(len(u.token_ids) for u in updates if u.request_id == "good") == 3
    assert not [u for u in updates if u.request_id == "slow"] and list(engine.compiling) == ["slow"]
    assert engine.snapshot().num_waiting == 1
    held_compiles.set()
    slow = [u for u in steps_to_the_end(engine) if u.request_id == "slow"]
    assert [t for u in slow for t in u.token_ids] == list(expected)
    assert slow[-1].finish_reason is not None and not engine.compiling


def test_a_compile_past_its_time_fails_its_request_alone(tiny_llama, held_compiles, monkeypatch):
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.3)
    engine, updates = beside_a_good_one(
        tiny_llama, SamplingParams(max_tokens=5, structure=("regex", "(ab)+"))
    )
    failed = [u for u in updates if isinstance(u, RequestFailed)]
    assert [u.request_id for u in failed] == ["bad"] and "did not compile within" in failed[
        0
    ].reason
    assert failed[0].invalid and not failed[0].retry
    assert sum(len(u.token_ids) for u in updates if u.request_id == "good") == 3
    assert engine.blocks.num_free_blocks == engine.num_blocks and not engine.sequences


def test_an_abort_while_its_grammar_compiles_leaves_nothing(tiny_llama, held_compiles) -> None:
    engine = LLMEngine(EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=3, structure=("regex", "a+")))
    assert engine.step() == [] and engine.has_unfinished
    assert engine.abort("r")
    assert not engine.has_unfinished and not engine.sequences and not engine.compiling
    assert engine.blocks.num_free_blocks == engine.num_blocks
    held_compiles.set()  # its compile ends with nobody waiting: the grammar is kept all the same
    engine.add_request("s", PROMPT, SamplingParams(max_tokens=3, structure=("regex", "b+")))
    steps_to_the_end(engine)
    assert engine.structures.ready(("regex", "a+")) and not engine.structures._compiling


def test_a_schema_the_grammar_compiler_refuses_fails_its_request_alone(tiny_llama) -> None:
    bad = SamplingParams(max_tokens=5, structure=("json_schema", '{"type": "nonsense"}'))
    engine, updates = beside_a_good_one(tiny_llama, bad)
    failed = [u for u in updates if isinstance(u, RequestFailed)]
    assert [u.request_id for u in failed] == ["bad"] and "cannot be used" in failed[0].reason
    assert failed[0].invalid and not failed[0].retry  # the client's error: a 400, no retry
    assert sum(len(u.token_ids) for u in updates if u.request_id == "good") == 3
    assert not engine.structures.matchers and not engine.has_unfinished


def test_a_format_nothing_can_match_fails_its_request_alone(tiny_llama) -> None:
    # Every token masked: sampling from all -inf picked a token outside the format, and the
    # request "stopped" with it.
    bad = SamplingParams(max_tokens=5, structure=("regex", r"[^\s\S]"))
    _, updates = beside_a_good_one(tiny_llama, bad)
    failed = [u for u in updates if isinstance(u, RequestFailed)]
    assert [u.request_id for u in failed] == ["bad"] and "nothing can match" in failed[0].reason
    assert failed[0].invalid and [u for u in updates if u.request_id == "bad"] == failed
    assert sum(len(u.token_ids) for u in updates if u.request_id == "good") == 3


def test_a_complete_format_ends_the_output_before_min_tokens(llm) -> None:
    # min_tokens blocks EOS where the format allows nothing but its end: the format wins, and
    # the output ends with EOS (every token masked, the sampler had picked token 0).
    for structure in (("regex", "(ab|cd)"), ("json_object", "")):
        params = SamplingParams(max_tokens=40, temperature=0, structure=structure, min_tokens=30)
        out = llm.generate_ids([PROMPT], params)[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_ids, out


def test_without_xgrammar_a_structured_request_says_how_to_get_it(tiny_llama, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    engine = LLMEngine(EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=3, structure=("regex", "a")))
    [failed] = steps_to_the_end(engine)
    assert isinstance(failed, RequestFailed) and "pip install xgrammar" in failed.reason


def test_kv_that_arrives_before_its_grammar_waits_out_of_the_batch(tiny_llama, held_compiles):
    """A decode worker's reservation: its KV (and first token) may come before its grammar has
    compiled. The request keeps its seat and blocks but samples nothing, and the engine thread
    never waits for the compile; once the grammar is ready it decodes inside the format."""
    config = EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64,
                          max_num_seqs=2)  # fmt: skip
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, structure=("regex", "x+"))
    assert engine.reserve("remote", PROMPT, params) is not None
    [x] = AutoTokenizer.from_pretrained(tiny_llama).encode("x", add_special_tokens=False)
    first = engine.admit("remote", x)  # the prefill worker's token (its KV is not sent here)
    assert first.token_ids == [x] and list(engine.compiling) == ["remote"]
    four = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("plain", PROMPT, four)
    engine.add_request("next", PROMPT, four)
    started = time.monotonic()
    updates = engine.step()
    assert [seq.request_id for seq in engine.scheduler.running] == ["plain"]
    assert not engine.has_room()  # "remote" keeps its seat while it waits: "next" waits too
    for _ in range(8):
        updates += engine.step()
    assert time.monotonic() - started < 5  # (the compile is held for 60 s)
    assert sum(len(u.token_ids) for u in updates if u.request_id in ("plain", "next")) == 8
    assert not [u for u in updates if u.request_id == "remote"]
    held_compiles.set()
    remote = [u for u in steps_to_the_end(engine) if u.request_id == "remote"]
    assert sum(len(u.token_ids) for u in remote) == 8 and remote[-1].finish_reason == "length"
    assert engine.blocks.num_free_blocks == engine.num_blocks


def test_an_abort_of_kv_waiting_for_its_grammar_frees_its_blocks(tiny_llama, held_compiles):
    engine = LLMEngine(EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64))
    params = SamplingParams(max_tokens=9, structure=("regex", "x+"))
    assert engine.reserve("remote", PROMPT, params) is not None
    engine.admit("remote", 5)
    assert engine.blocks.num_free_blocks < engine.num_blocks and engine.compiling
    assert engine.abort("remote")
    assert engine.blocks.num_free_blocks == engine.num_blocks
    assert not engine.compiling and not engine.sequences and not engine.has_unfinished


def test_a_format_that_fails_to_compile_is_compiled_once_for_all_its_requests(tiny_llama):
    engine = LLMEngine(EngineConfig(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64))
    calls = []
    real = engine.structures._compile_now
    engine.structures._compile_now = lambda spec: calls.append(spec) or real(spec)  # type: ignore[method-assign]
    bad = SamplingParams(max_tokens=3, structure=("json_schema", '{"type": "nonsense"}'))
    for i in range(3):
        engine.add_request(f"r{i}", PROMPT, bad)
    failed = steps_to_the_end(engine)
    assert sorted(u.request_id for u in failed) == ["r0", "r1", "r2"]
    assert all(isinstance(u, RequestFailed) and "cannot be used" in u.reason for u in failed)
    assert len(calls) == 1
