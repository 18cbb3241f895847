"""The default model over HTTP: greedy text is identical to what `tandem generate` prints."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from engine.config import EngineConfig
from engine.local_client import LocalEngineClient

QUESTION = "Explain in one sentence why the sky is blue."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def api(serve, smollm2) -> openai.OpenAI:
    # The engine settings `tandem generate` uses (its defaults, in float32 on both sides), so
    # both runs are the same math. In bfloat16 the second request, whose prompt blocks come
    # from the prefix cache, may pick the other side of a near tie (docs/architecture.md,
    # "Correctness"): on a Sapphire Rapids VM its 9th token did.
    client = LocalEngineClient.from_config(EngineConfig(model=smollm2, dtype="float32"), "smollm2")
    server = serve(client)
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def tandem_generate(smollm2, *flags: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "cli.main", "generate", "--model", str(smollm2),
         "--prompt", QUESTION, "--max-tokens", str(MAX_TOKENS), "--dtype", "float32", "--json",
         *flags],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_greedy_chat_is_identical_to_tandem_generate(api, smollm2) -> None:
    want = tandem_generate(smollm2, "--chat")
    got = api.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert got.choices[0].message.content == want["text"]
    assert got.choices[0].finish_reason == want["finish_reason"]
    assert got.usage.completion_tokens == len(want["token_ids"])
    streamed = api.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == want["text"]
