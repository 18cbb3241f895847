"""EngineConfig's step token budget: given, or chosen for the device."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.config import ConfigError, EngineConfig


def test_step_budget_follows_the_device_unless_given() -> None:
    assert EngineConfig("m", device="cpu").max_num_batched_tokens == 256
    assert EngineConfig("m", device="cuda").max_num_batched_tokens == 2048
    assert EngineConfig("m", device="cuda:1").max_num_batched_tokens == 2048
    assert (
        EngineConfig("m", device="cpu", max_num_batched_tokens=4096).max_num_batched_tokens == 4096
    )
    # never fewer than the running sequences, each of which takes a token a step
    assert EngineConfig("m", device="cpu", max_num_seqs=512).max_num_batched_tokens == 512
    # tandem serve's "auto" waits for the cluster's device, then takes its budget
    auto = EngineConfig("m", device="auto")
    assert auto.max_num_batched_tokens is None
    assert replace(auto, device="cpu").max_num_batched_tokens == 256
    assert replace(auto, device="cuda").max_num_batched_tokens == 2048
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be at least 1"):
        EngineConfig("m", device="cpu", max_num_batched_tokens=0)
