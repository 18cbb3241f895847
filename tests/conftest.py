"""Shared fixtures: tiny offline checkpoints (built once per session) and the default model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.checkpoints import build_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    built: dict[str, Path] = {}

    def get(family: str, **overrides: object) -> Path:
        key = family + "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
        if key not in built:
            folder = tmp_path_factory.mktemp(key.replace("=", "_"))
            built[key] = build_checkpoint(folder, family, **overrides)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_llama(checkpoints) -> Path:
    return checkpoints("llama")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from engine.fetch import fetch_default_model

    return fetch_default_model()
