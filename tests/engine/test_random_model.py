"""`tandem make-model` folders: loadable by transformers and by the engine, the same bytes from
the same seed, sharded like Hugging Face's, and on a GPU within bf16 of transformers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cli.main import main
from engine import random_model
from engine.llm import LLM
from engine.random_model import make_model
from protocol.sampling import SamplingParams
from tests.support.hf_reference import hf_greedy

GREEDY_8 = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        h.update(path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def smollm2_1layer(tmp_path_factory) -> Path:
    return make_model("smollm2-135m", tmp_path_factory.mktemp("m") / "a", num_layers=1)


def make_model_folder(tmp: Path, name: str, **options) -> Path:
    folder = tmp / name
    make_model("smollm2-135m", folder, num_layers=1, **options)
    return folder


def test_folder_loads_in_transformers_and_the_engine_agrees(tmp_path: Path) -> None:
    folder = make_model_folder(tmp_path, "m")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        1, 576, 49152,
    )  # fmt: skip
    llm = LLM(folder, dtype="float32")
    prompt = llm.tokenizer.encode("The quick brown fox")
    ours = llm.generate_ids([prompt], GREEDY_8)[0].token_ids
    assert ours == hf_greedy(folder, prompt, 8)


def test_every_id_decodes_to_text(tmp_path: Path) -> None:
    folder = make_model_folder(tmp_path, "m")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 49152
    assert tokenizer.decode([49151]) == " w49151"
    assert tokenizer.decode([random_model.TRAINED_VOCAB + 7]) != ""
    text = "Paged attention stores keys"  # encoding uses the learned merges, not the filler
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert max(tokenizer.encode(text)) < random_model.TRAINED_VOCAB


def test_the_same_seed_writes_the_same_bytes(tmp_path: Path) -> None:
    first = make_model_folder(tmp_path, "a")
    again = make_model_folder(tmp_path, "b")
    other = make_model_folder(tmp_path, "c", seed=1)
    assert digest(first) == digest(again)
    assert digest(first) != digest(other)


def test_shards_and_their_index_load_as_one_file_does(tmp_path: Path, monkeypatch) -> None:
    whole = make_model_folder(tmp_path, "whole")
    monkeypatch.setattr(random_model, "SHARD_BYTES", 20 << 20)  # the 56 MB embedding alone
    sharded = make_model_folder(tmp_path, "sharded")
    index = json.loads((sharded / random_model.INDEX_FILE).read_text())
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) >= 2
    assert sorted(set(index["weight_map"].values())) == files
    prompt = [5, 6, 7, 8]
    assert (
        LLM(sharded, dtype="float32").generate_ids([prompt], GREEDY_8)[0].token_ids
        == LLM(whole, dtype="float32").generate_ids([prompt], GREEDY_8)[0].token_ids
    )


def test_cli_refuses_a_folder_with_files_in_it(tmp_path: Path, capsys) -> None:
    (tmp_path / "x").write_text("keep me")
    code = main(["make-model", "--arch", "smollm2-135m", "--out", str(tmp_path)])
    assert code == 1
    assert "is not an empty folder" in capsys.readouterr().err
    assert (tmp_path / "x").read_text() == "keep me"


def test_cli_names_the_known_architectures(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["make-model", "--arch", "gpt-5", "--out", "/tmp/never"])
    assert exit_info.value.code == 2
    assert "llama-3.1-8b" in capsys.readouterr().err


# ---- on a GPU: full-size shapes against transformers ------------------------------------------


def step_logits(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The engine's greedy tokens and, for each, the logits it chose from: [n, vocab]."""
    captured = []
    original = llm.engine.runner.model.forward

    def spy(batch, kv_caches, on_layer=None):
        logits = original(batch, kv_caches, on_layer)
        captured.append(logits[-1].float().cpu())
        return logits

    llm.engine.runner.model.forward = spy
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0)
    tokens = llm.generate_ids([prompt], params)[0].token_ids
    llm.engine.runner.model.forward = original
    return tokens, torch.stack(captured)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama-3.2-1b", "qwen3-0.6b"])
def test_full_shape_on_cuda_within_bf16_of_transformers(tmp_path: Path, arch: str) -> None:
    """bf16 engine on the GPU (eager: each step's logits are seen) against transformers in
    float32 on the same weights, teacher-forced on the engine's own tokens. The margin: if
    every logit is within d of the reference, the top token can differ only where the
    reference's top two are within 2d; so the tokens must agree wherever the margin is wider
    than twice the largest deviation seen at that step."""
    folder = tmp_path / arch
    make_model(arch, folder)
    llm = LLM(folder, dtype="bfloat16", device="cuda", cuda_graphs=False, max_num_seqs=4)
    prompt = llm.tokenizer.encode("Paged attention stores keys and values in blocks.")
    tokens, ours = step_logits(llm, prompt, 32)
    del llm
    torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda()
    with torch.no_grad():
        full = torch.tensor([prompt + tokens[:-1]], device="cuda")
        ref = hf(full).logits[0, len(prompt) - 1 :].float().cpu()  # [32, vocab]
    deviation = (ours - ref).abs().amax(dim=-1)
    scale = ref.abs().amax(dim=-1)
    assert (deviation <= 0.05 * scale + 0.02).all(), (deviation, scale)
    top2 = ref.topk(2, dim=-1)
    margin = top2.values[:, 0] - top2.values[:, 1]
    clear = margin > 2 * deviation
    assert clear.sum() >= 8  # the check must decide steps, or it says nothing
    chosen = torch.tensor(tokens)
    assert (chosen[clear] == top2.indices[clear, 0]).all()


def test_more_layers_than_the_architecture_has_are_refused(tmp_path: Path) -> None:
    """A million layers ran on towards terabytes of weights."""
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 30\]"):
        make_model("smollm2-135m", tmp_path / "m", num_layers=1_000_000)
    assert not (tmp_path / "m").exists()
