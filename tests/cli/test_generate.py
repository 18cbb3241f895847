"""`tandem generate` and its error paths: one line on stderr, non-zero exit, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import build_parser
from engine.llm import LLM
from protocol.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def loaded_after(code: str, modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` a fresh interpreter has imported after running `code`."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {modules!r} if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_parser_loads_neither_torch_nor_ray() -> None:
    code = "import cli.main; cli.main.build_parser()"
    assert loaded_after(code, ("torch", "ray")) == []


def test_subcommands_do_not_import_the_dispatcher() -> None:
    code = "import cli.generate, cli.serve, loadtest.cli"
    assert loaded_after(code, ("cli.main",)) == []


def test_help_exits_0() -> None:
    result = tandem("--help")
    assert result.returncode == 0, result.stderr
    assert all(command in result.stdout for command in ("generate", "serve", "bench"))


@pytest.mark.parametrize("text,top_k", [("40", 40), ("1", 1), ("0", None), ("-1", None)])
def test_top_k_zero_or_minus_one_is_off(text, top_k) -> None:
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--top-k", text])
    assert args.top_k == top_k


def test_generate_defaults() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert (args.top_k, args.top_p, args.temperature, args.dtype) == (None, 1.0, 0.0, "bfloat16")


def assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], result.stderr


def test_generate_json_matches_python_api(tiny_llama) -> None:
    result = tandem(
        "generate", "--model", str(tiny_llama), "--prompt", "The quick", "--prompt", "0123",
        "--max-tokens", "6", "--dtype", "float32", "--ignore-eos", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    expected = LLM(tiny_llama, dtype="float32").generate(
        ["The quick", "0123"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    assert [r["token_ids"] for r in records] == [e.token_ids for e in expected]
    assert [r["text"] for r in records] == [e.text for e in expected]
    assert all(r["finish_reason"] == "length" for r in records)


def test_missing_folder(tmp_path) -> None:
    result = tandem("generate", "--model", str(tmp_path / "none"), "--prompt", "hi")
    assert_one_line_error(result, "does not exist")


def test_bad_flag_value() -> None:
    result = tandem("generate", "--prompt", "hi", "--max-tokens", "many")
    assert result.returncode == 2
    assert_one_line_error(result, "invalid int value")


def test_unknown_flag() -> None:
    result = tandem("generate", "--prompt", "hi", "--bogus")
    assert_one_line_error(result, "--bogus")
    assert result.stderr.startswith("tandem generate: error: unrecognized arguments: --bogus")
    assert "(see tandem generate --help)" in result.stderr  # the subcommand's, not tandem's


def test_bad_sampling_value(tiny_llama) -> None:
    result = tandem("generate", "--model", str(tiny_llama), "--prompt", "hi", "--top-p", "0")
    assert_one_line_error(result, "top_p")


def test_max_tokens_past_the_context(tiny_llama) -> None:
    args = ("generate", "--model", str(tiny_llama), "--prompt", "hi", "--max-tokens", "100000")
    assert_one_line_error(tandem(*args), "is more than this model's context")


@pytest.fixture
def broken(tiny_llama, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_llama, folder)
    return folder


def test_unsupported_architecture(broken) -> None:
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["BertModel"]
    (broken / "config.json").write_text(json.dumps(config))
    result = tandem("generate", "--model", str(broken), "--prompt", "hi")
    assert_one_line_error(result, "unsupported architecture BertModel")


def test_corrupt_weights(broken) -> None:
    weights = broken / "model.safetensors"
    weights.write_bytes(b"\x00" * 64)
    result = tandem("generate", "--model", str(broken), "--prompt", "hi")
    assert_one_line_error(result, "model.safetensors")


def test_transformers_does_not_mistake_our_kernels_package() -> None:
    from transformers.utils import import_utils

    assert not import_utils.is_kernels_available()


@pytest.mark.parametrize("text", ["-5", "-2"])
def test_a_negative_top_k_other_than_minus_one_is_refused_in_cli_words(text, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "hi", "--top-k", text])
    err = capsys.readouterr().err
    assert f"{text} is not a top-k: give 1 or more, or 0 for off" in err and "None" not in err
