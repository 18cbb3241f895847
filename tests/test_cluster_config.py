"""cluster.yaml and deploy/cluster.local.yaml: valid for `ray up`, and their shell commands do what
their comments say when run the way Ray's node updater runs them, against stand-in `ray`, `uv`,
`nvidia-smi` and `huggingface_hub`."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

REPO = Path(__file__).resolve().parent.parent
AWS = REPO / "cluster.yaml"
LOCAL = REPO / "deploy" / "cluster.local.yaml"
HEAD_IP = "10.0.0.1"

# Records each call as one JSON line {"prog": ..., "args": [...]}; as `uv venv DIR` it also
# creates DIR/bin/python, a wrapper around the interpreter running these tests.
RECORDER = f"""#!{sys.executable} -S
import json, os, sys
prog, args = os.path.basename(sys.argv[0]), sys.argv[1:]
with open(os.path.join(os.environ["HOME"], "calls.jsonl"), "a") as calls:
    calls.write(json.dumps({{"prog": prog, "args": args}}) + "\\n")
if prog == "uv" and args[:1] == ["venv"]:
    bin_dir = os.path.join(args[-1], "bin")
    os.makedirs(bin_dir)
    with open(os.path.join(bin_dir, "python"), "w") as python:
        python.write('#!/bin/sh\\nexec {sys.executable} "$@"\\n')
    os.chmod(os.path.join(bin_dir, "python"), 0o755)
"""
NVIDIA_SMI = """#!/bin/sh
i=0
while [ "$i" -lt "${FAKE_GPUS:-0}" ]; do
    echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; i=$((i + 1))
done
"""
HUGGINGFACE_HUB = """import json, os
def snapshot_download(repo_id, local_dir):
    with open(os.path.join(os.environ["HOME"], "calls.jsonl"), "a") as calls:
        calls.write(json.dumps({"prog": "snapshot_download", "args": [repo_id, local_dir]}) + "\\n")
"""


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def write_executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def node(tmp_path: Path) -> Path:
    """A fake node's home: uv already installed, `ray` and `nvidia-smi` on PATH, no network."""
    write_executable(tmp_path / "fakebin" / "ray", RECORDER)
    write_executable(tmp_path / "fakebin" / "nvidia-smi", NVIDIA_SMI)
    write_executable(tmp_path / "fakebin" / "curl", "#!/bin/sh\necho no network >&2; exit 7\n")
    write_executable(tmp_path / ".local" / "bin" / "uv", RECORDER)
    (tmp_path / "stubs").mkdir()
    (tmp_path / "stubs" / "huggingface_hub.py").write_text(HUGGINGFACE_HUB)
    (tmp_path / ".bashrc").write_text("")
    return tmp_path


def run_on_node(
    home: Path, commands: list[str], gpus: int = 0
) -> tuple[subprocess.CompletedProcess | None, list[dict]]:
    """Runs commands in order as Ray's updater does (bashrc, then the command in a subshell with
    RAY_HEAD_IP exported); stops at the first failure and returns it, plus every recorded call."""
    env = {
        "HOME": str(home),
        "PATH": f"{home / 'fakebin'}:/usr/bin:/bin",
        "PYTHONPATH": str(home / "stubs"),
        "FAKE_GPUS": str(gpus),
    }
    failed = None
    for command in commands:
        wrapped = f"source ~/.bashrc; (export RAY_HEAD_IP={HEAD_IP}; {command})"
        result = subprocess.run(
            ["bash", "-c", wrapped], env=env, capture_output=True, text=True, timeout=60
        )
        if result.returncode != 0:
            failed = result
            break
    calls_file = home / "calls.jsonl"
    lines = calls_file.read_text().splitlines() if calls_file.exists() else []
    return failed, [json.loads(line) for line in lines]


def ray_starts(calls: list[dict]) -> list[list[str]]:
    return [c["args"][1:] for c in calls if c["prog"] == "ray" and c["args"][:1] == ["start"]]


# --- validity for `ray up` ---------------------------------------------------------------------


@pytest.mark.parametrize("path", [AWS, LOCAL], ids=["aws", "local"])
def test_matches_the_schema_shipped_with_ray(path: Path) -> None:
    schema_file = resources.files("ray.autoscaler") / "ray-schema.json"
    schema = json.loads(schema_file.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(load(path))]
    assert errors == []


def test_ray_prepares_the_aws_config() -> None:
    config = prepare_config(load(AWS))
    validate_config(config)
    types = config["available_node_types"]
    assert config["head_node_type"] == "head"
    assert set(types) == {"head", "prefill_gpu", "decode_gpu"}
    assert sum(types[t]["min_workers"] for t in types) <= config["max_workers"]


def test_ray_prepares_the_local_config() -> None:
    raw = load(LOCAL)
    assert "available_node_types" not in raw  # the local provider aborts on it
    config = prepare_config(raw)
    validate_config(config)
    (only_type,) = config["available_node_types"].values()
    assert only_type["min_workers"] == len(raw["provider"]["worker_ips"])


# --- what the AWS node types carry -------------------------------------------------------------


def test_head_has_no_gpu_and_no_pool_resource() -> None:
    head = load(AWS)["available_node_types"]["head"]["resources"]
    assert head["GPU"] == 0 and head["CPU"] > 0
    assert "prefill" not in head and "decode" not in head


@pytest.mark.parametrize(
    ("node_type", "role"), [("prefill_gpu", "prefill"), ("decode_gpu", "decode")]
)
def test_gpu_pool_offers_one_role_unit_per_gpu(node_type: str, role: str) -> None:
    spec = load(AWS)["available_node_types"][node_type]
    other = {"prefill": "decode", "decode": "prefill"}[role]
    assert spec["resources"]["GPU"] > 0
    assert spec["resources"][role] == spec["resources"]["GPU"]
    assert other not in spec["resources"]
    assert spec["labels"] == {"tandem-role": role}
    assert 0 <= spec["min_workers"] <= spec["max_workers"]


# --- the shell commands, run on a fake node ----------------------------------------------------


def test_both_files_install_the_same_way() -> None:
    assert load(AWS)["setup_commands"] == load(LOCAL)["setup_commands"]


def test_setup_installs_tandem_and_the_model_idempotently(node: Path) -> None:
    setup = load(AWS)["setup_commands"]
    for _ in range(2):  # `ray up` re-runs setup on every update
        failed, calls = run_on_node(node, setup)
        assert failed is None, failed and failed.stderr

    venv = node / "tandem-venv"
    assert [c["args"] for c in calls if c["args"][:1] == ["venv"]] == [
        ["venv", "--python", "3.11", str(venv)]
    ]
    installs = [c["args"] for c in calls if c["args"][:2] == ["pip", "install"]]
    assert len(installs) == 2
    spec = installs[0]
    assert spec[2:4] == ["--python", str(venv)]
    assert spec[4].startswith("ray[default]==")
    assert spec[5].startswith("tandem")
    downloads = [c["args"] for c in calls if c["prog"] == "snapshot_download"]
    assert downloads[0] == ["Qwen/Qwen2.5-7B-Instruct", str(node / "models/Qwen2.5-7B-Instruct")]
    assert (node / ".bashrc").read_text().count("tandem-venv/bin") == 1

    run_on_node(node, ["command -v python > ~/which-python"])
    assert (node / "which-python").read_text().strip() == str(venv / "bin" / "python")


def test_aws_start_commands_leave_resources_to_the_node_type(node: Path) -> None:
    config = load(AWS)
    failed, calls = run_on_node(node, config["head_start_ray_commands"])
    assert failed is None
    (head_start,) = ray_starts(calls)
    assert "--head" in head_start and "--port=6379" in head_start

    failed, calls = run_on_node(node, config["worker_start_ray_commands"], gpus=8)
    assert failed is None
    _, worker_start = ray_starts(calls)
    assert f"--address={HEAD_IP}:6379" in worker_start
    # The autoscaler exports RAY_OVERRIDE_RESOURCES from the node type; no flag may contradict it.
    assert not any(arg.startswith("--resources") for arg in worker_start)


@pytest.mark.parametrize(("role", "gpus"), [("prefill", 8), ("decode", 4)])
def test_local_worker_advertises_the_role_in_its_file(node: Path, role: str, gpus: int) -> None:
    (node / ".tandem-role").write_text(f"{role}\n")
    failed, calls = run_on_node(node, load(LOCAL)["worker_start_ray_commands"], gpus=gpus)
    assert failed is None, failed and failed.stderr
    (start,) = ray_starts(calls)
    assert f"--address={HEAD_IP}:6379" in start
    (resources_arg,) = [a for a in start if a.startswith("--resources=")]
    assert json.loads(resources_arg.removeprefix("--resources=")) == {role: gpus}
    assert f"--labels=tandem-role={role}" in start


@pytest.mark.parametrize(
    ("role_file", "gpus", "message"),
    [(None, 8, "must say prefill or decode"), ("both", 8, "not 'both'"), ("decode", 0, "no GPU")],
    ids=["missing", "unknown-role", "no-gpu"],
)
def test_local_worker_refuses_to_start_misconfigured(
    node: Path, role_file: str | None, gpus: int, message: str
) -> None:
    if role_file is not None:
        (node / ".tandem-role").write_text(role_file)
    failed, calls = run_on_node(node, load(LOCAL)["worker_start_ray_commands"], gpus=gpus)
    assert failed is not None and message in failed.stderr
    assert ray_starts(calls) == []


def test_local_head_starts_without_a_role(node: Path) -> None:
    failed, calls = run_on_node(node, load(LOCAL)["head_start_ray_commands"])
    assert failed is None
    (start,) = ray_starts(calls)
    assert "--head" in start and not any(a.startswith("--resources") for a in start)
