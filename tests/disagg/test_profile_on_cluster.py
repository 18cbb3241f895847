"""`tandem profile --address`: the step sweep runs in a Ray actor on a node of the cluster (here
the session's local cluster), and the fitted profile is saved by the process that asked; a
node that never turns up, or a sweep that fails there, is one line and exit 1, within the
deadline given."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import pytest

from cli.main import main
from planning.cost_model import StepCostModel


def test_the_sweep_runs_on_a_cluster_node_and_the_profile_is_saved_here(
    ray_cluster, tiny_llama: Path, tmp_path: Path, capsys
) -> None:
    output = tmp_path / "profile.json"
    argv = ["profile", "--quick", "--address", "auto", "--model", str(tiny_llama),
            "--dtype", "float32", "--max-batch", "8", "--output", str(output)]  # fmt: skip
    assert main(argv) == 0
    model = StepCostModel.load(output)
    info = model.info
    assert (info.source, info.device, info.host) == ("sweep", "cpu", socket.gethostname())
    assert info.model == tiny_llama.name and info.tensor_parallel == 1
    assert model.stats.num_train > 0 and model.stats.num_heldout > 0
    out, err = capsys.readouterr()
    assert f"sweeping on {socket.gethostname()} (cpu" in err and f"wrote {output}" in out
    # The actor is gone with the sweep: nothing of it holds the cluster's resources.
    deadline = time.monotonic() + 30
    while ray_cluster.available_resources().get("CPU") != ray_cluster.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, "the sweep's actor still holds its CPU"
        time.sleep(0.2)


def test_a_pool_no_node_offers_fails_at_the_placement_deadline(
    ray_cluster, tiny_llama: Path, tmp_path: Path, capsys
) -> None:
    assert ray_cluster.cluster_resources().get("decode", 0) == 0
    output = tmp_path / "profile.json"
    argv = ["profile", "--quick", "--address", "auto", "--model", str(tiny_llama),
            "--pool", "decode", "--placement-timeout", "2", "--output", str(output)]  # fmt: skip
    start = time.monotonic()
    assert main(argv) == 1
    assert time.monotonic() - start < 20
    err = capsys.readouterr().err
    assert err.startswith("tandem profile: error: no node of the cluster could take the sweep")
    assert "(1 decode) within 2 s" in err and err.count("\n") == 1
    assert not output.exists()


def test_a_sweep_that_fails_on_its_node_is_one_line(
    ray_cluster, tiny_llama: Path, tmp_path: Path, capsys
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not weights")  # the config reads; loading the weights fails there
    output = tmp_path / "profile.json"
    argv = ["profile", "--quick", "--address", "auto", "--model", str(broken),
            "--output", str(output)]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"profile: sweeping on {socket.gethostname()} (cpu, tensor parallel 1)"
    assert err[1].startswith(f"tandem profile: error: the sweep on {socket.gethostname()} failed:")
    assert len(err) == 2 and not output.exists()


def test_a_model_that_does_not_split_is_refused_before_any_node_is_asked(
    ray_cluster, tiny_llama: Path, capsys
) -> None:
    argv = ["profile", "--quick", "--address", "auto", "--model", str(tiny_llama), "-tp", "3"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("tandem profile: error: tensor parallel size 3 does not divide")
    assert "sweeping on" not in err


@pytest.mark.parametrize(
    "argv,error",
    [
        (["--pool", "decode"], "--pool needs --address"),
        (["--placement-timeout", "5"], "--placement-timeout needs --address"),
        (["--sweep-timeout", "1"], "--sweep-timeout needs --address"),
        (["--address", "auto", "--from-telemetry", "x.json"], "--from-telemetry fits records"),
        (["--address", "auto", "--transport", "gloo"], "only the step sweep runs on the cluster"),
        (["-tp", "0"], "--tensor-parallel-size must be at least 1"),
        (["--address", "auto", "--placement-timeout", "0"], "--placement-timeout must be"),
        (["--address", "auto", "--sweep-timeout", "inf"], "--sweep-timeout must be a positive"),
    ],
)
def test_cluster_flag_errors(argv: list[str], error: str, capsys) -> None:
    assert main(["profile", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tandem profile: error:") and error in err
