"""deploy/gpu_kit.py without the network: Ray's jars dropped from a wheel (its RECORD too) with
every other entry's bytes and permissions kept, and the tokenizer a random model needs."""

from __future__ import annotations

import importlib.util
import stat
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "gpu_kit.py"
_spec = importlib.util.spec_from_file_location("gpu_kit", SCRIPT)
gpu_kit = importlib.util.module_from_spec(_spec)
sys.modules["gpu_kit"] = gpu_kit
_spec.loader.exec_module(gpu_kit)


def entry(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.external_attr = (stat.S_IFREG | mode) << 16
    return info


def test_ray_jars_leave_the_wheel_and_its_record(tmp_path: Path) -> None:
    wheel = tmp_path / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"
    record = (
        "ray/__init__.py,sha256=a,3\nray/jars/ray_dist.jar,sha256=b,4\nray/core/raylet,sha256=c,5\n"
    )
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(entry("ray/__init__.py", 0o644), "x=1")
        z.writestr(entry("ray/jars/ray_dist.jar", 0o644), b"java")
        z.writestr(entry("ray/core/raylet", 0o755), b"\x7fELF")
        z.writestr(entry("ray-2.60.0.dist-info/RECORD", 0o644), record)
    gpu_kit.strip_jars(wheel)
    with zipfile.ZipFile(wheel) as z:
        assert z.namelist() == ["ray/__init__.py", "ray/core/raylet", "ray-2.60.0.dist-info/RECORD"]
        assert z.read("ray/core/raylet") == b"\x7fELF"
        assert (z.getinfo("ray/core/raylet").external_attr >> 16) & 0o777 == 0o755
        assert z.read("ray-2.60.0.dist-info/RECORD").decode() == (
            "ray/__init__.py,sha256=a,3\nray/core/raylet,sha256=c,5\n"
        )


def test_the_tokenizer_is_copied_without_weights(tiny_llama: Path, tmp_path: Path) -> None:
    gpu_kit.copy_tokenizer(tiny_llama, tmp_path / "source")
    copied = sorted(p.name for p in (tmp_path / "source").iterdir())
    assert "config.json" in copied and "tokenizer.json" in copied
    assert not any(name.endswith(".safetensors") for name in copied)
    with pytest.raises(SystemExit, match="no config.json or tokenizer.json"):
        gpu_kit.copy_tokenizer(tmp_path / "empty", tmp_path / "other")


def test_failures_are_logged_as_they_happen(tmp_path, monkeypatch) -> None:
    """deploy/gpu_run.sh's TANDEM_FAILURE_LOG: a GPU run cut off at its deadline keeps the
    tracebacks of the failures it had."""
    from types import SimpleNamespace

    from tests import conftest

    log = tmp_path / "failures.log"
    monkeypatch.setattr(conftest, "FAILURE_LOG", str(log))
    for failed, name in ((True, "tests/a.py::t1"), (False, "tests/a.py::t2")):
        report = SimpleNamespace(failed=failed, nodeid=name, when="call", longreprtext="boom")
        conftest.pytest_runtest_logreport(report)
    assert log.read_text() == "=== tests/a.py::t1 (call)\nboom\n\n"
