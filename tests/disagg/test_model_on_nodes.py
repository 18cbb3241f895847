"""Where a worker finds its model on its own node (worker/actor.py `local_model`): the head names
the folder; another node has it at the same path, fetches the default model itself, or says
plainly that it lacks it. No Ray needed: the function runs in the test process."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine.fetch
from engine.config import ConfigError
from worker.actor import local_model


def test_a_folder_on_this_node_is_used_as_named(tmp_path: Path) -> None:
    assert local_model(tmp_path, "10.0.0.7") == tmp_path


def test_a_node_without_the_default_model_fetches_its_own(tmp_path: Path, monkeypatch) -> None:
    fetched = tmp_path / "here" / "models" / engine.fetch.DEFAULT_MODEL_NAME
    monkeypatch.setattr(engine.fetch, "fetch_default_model", lambda log=None: fetched)
    heads = Path("/home/head/.cache/tandem/models") / engine.fetch.DEFAULT_MODEL_NAME
    assert local_model(heads, "10.0.0.7") == fetched


def test_a_node_without_another_model_says_which_node_and_path(monkeypatch) -> None:
    monkeypatch.setattr(engine.fetch, "fetch_default_model", pytest.fail)
    with pytest.raises(ConfigError, match=r"/models/llama-8b is not on node 10\.0\.0\.7"):
        local_model(Path("/models/llama-8b"), "10.0.0.7")
