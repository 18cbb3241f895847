"""Packs what a lent GPU machine needs and lacks into .gpukit/, for deploy/gpu_run.sh there.

    python deploy/gpu_kit.py            # here, with PyPI reachable: ~60 MiB in .gpukit/
    device run, carry [".gpukit"]:  bash deploy/gpu_run.sh

That machine reaches no package registry. It has Python 3.12, torch, Triton, transformers,
safetensors, msgpack, httpx, aiohttp, pytest; it lacks Ray, FastAPI, uvicorn, uvloop and pydantic,
whatever they need beyond its own packages, and py-spy. So this downloads those wheels for
CPython 3.12 (the versions pinned below are the ones the CPU machine's tests ran with), drops
Ray's Java jars (32 MB that only Java workers load: the rest of a call's 64 MiB is for the
working tree), and copies SmolLM2-135M-Instruct's config and tokenizer: the vocabulary of the
random-weight model benchmarks/serving.py builds there ("gpu-0.5b"), since no model can be
downloaded either.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.serving import TOKENIZER_FILES  # noqa: E402

KIT = ROOT / ".gpukit"
# Beside the machine's own packages (device/KINDS.md lists them): these and what they need.
WHEELS = (
    "ray==2.60.0",
    "fastapi==0.165.0",
    "starlette==1.10.0",
    "uvicorn==0.54.0",
    "httptools==0.9.0",
    # The event loop a real install serves on (uvicorn picks it up) and the clients run on
    # (loadtest/event_loop.py); without it a GPU run measured asyncio's slower loop.
    "uvloop==0.23.0",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing_extensions==4.16.0",
    "opentelemetry-api==1.45.2",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "py-spy==0.4.3",  # gpu_run.sh's profile step: where 1P1D's workers spend their time
)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
MAX_KIT_BYTES = 60 << 20  # a call carries 64 MiB, the working tree (~2 MB) included


def download(dest: Path) -> None:
    platforms = [f"--platform={p}" for p in PLATFORMS]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
               *platforms, "--dest", str(dest), *WHEELS]  # fmt: skip
    subprocess.run(command, check=True)


def strip_jars(wheel: Path) -> None:
    """Rewrites a Ray wheel without ray/jars/ (and without their lines in its RECORD); every
    other entry keeps its bytes and its permissions (the gcs and raylet binaries run)."""
    stripped = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(stripped, "w") as out:
        for info in src.infolist():
            if info.filename.startswith("ray/jars/"):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(x for x in lines if not x.startswith("ray/jars/")).encode()
            info.compress_type = zipfile.ZIP_DEFLATED
            out.writestr(info, data)
    stripped.replace(wheel)


def copy_tokenizer(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):  # what write_random_model reads
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
    if not (dest / "config.json").is_file() or not (dest / "tokenizer.json").is_file():
        raise SystemExit(f"gpu_kit: {source} has no config.json or tokenizer.json")


def kit_bytes(kit: Path) -> int:
    return sum(f.stat().st_size for f in kit.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, help="SmolLM2's folder (default: fetched if missing)")
    args = p.parse_args(argv)
    shutil.rmtree(KIT, ignore_errors=True)
    download(KIT / "wheels")
    for wheel in (KIT / "wheels").glob("ray-*.whl"):
        strip_jars(wheel)
    if args.source is None:
        from engine.fetch import fetch_default_model

        args.source = fetch_default_model(print)
    copy_tokenizer(args.source, KIT / "source")
    size = kit_bytes(KIT)
    print(f"{KIT}: {size / 2**20:.1f} MiB")
    if size > MAX_KIT_BYTES:
        print(f"gpu_kit: over {MAX_KIT_BYTES >> 20} MiB: a call could not carry it")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
