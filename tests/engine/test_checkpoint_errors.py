"""Configs and weights tandem cannot run fail with a message naming what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine.config import ConfigError, ModelConfig
from engine.llm import LLM
from engine.weights import WeightsError


@pytest.fixture
def copy(tiny_llama, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    return folder


def edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_unsupported_architecture_names_the_supported_ones(copy) -> None:
    edit_config(copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_pretrained(copy)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        ({"hidden_size": "wide"}, "hidden_size must be a positive integer"),
    ],
)
def test_a_config_with_impossible_sizes_is_named(copy, change, message) -> None:
    edit_config(copy, **change)  # (a ZeroDivisionError or a TypeError before)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_pretrained(copy)


def test_a_config_missing_a_field_or_not_an_object_is_named(copy) -> None:
    config = json.loads((copy / "config.json").read_text())
    del config["num_attention_heads"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="has no 'num_attention_heads'"):
        ModelConfig.from_pretrained(copy)
    (copy / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match="holds no JSON object"):
        ModelConfig.from_pretrained(copy)


def test_missing_folder(tmp_path) -> None:
    with pytest.raises(ConfigError, match="config.json not found"):
        ModelConfig.from_pretrained(tmp_path / "nothing")


def test_config_reads_eos_gqa_and_tied_embeddings(checkpoints) -> None:
    cfg = ModelConfig.from_pretrained(checkpoints("qwen3"))
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and cfg.tie_word_embeddings
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 32)
    assert cfg.eos_token_ids == (2,)
    assert ModelConfig.from_pretrained(checkpoints("qwen2")).qkv_bias


def test_missing_tensor_is_named(copy) -> None:
    tensors = load_file(copy / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        WeightsError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        LLM(copy)


def test_wrong_shape_is_named(copy) -> None:
    tensors = load_file(copy / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        WeightsError, match=r"model\.norm\.weight has shape \(10,\), expected \(64,\)"
    ):
        LLM(copy)


def test_corrupt_file_is_reported(copy) -> None:
    path = copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(WeightsError, match="model.safetensors"):
        LLM(copy)


def test_sharded_checkpoint_loads_the_same(copy, tiny_llama) -> None:
    tensors = load_file(copy / "model.safetensors")
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, copy / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (copy / "model.safetensors").unlink()
    (copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompt = [[5, 6, 7, 8]]
    from protocol.sampling import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    sharded = LLM(copy, dtype="float32").generate_ids(prompt, params)
    single = LLM(tiny_llama, dtype="float32").generate_ids(prompt, params)
    assert sharded[0].token_ids == single[0].token_ids
