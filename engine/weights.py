"""Load a checkpoint's safetensors (one file or sharded) into a CausalLM, checking every tensor."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.model import CausalLM, Piece

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class WeightsError(ValueError):
    """A checkpoint whose tensors are missing, misshapen or unreadable."""


def tensor_files(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the file holding it."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise WeightsError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}")
    with _open(single) as handle:
        return dict.fromkeys(handle.keys(), single)


@contextmanager
def _open(path: Path) -> Iterator:
    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except (SafetensorError, OSError) as err:
        raise WeightsError(f"cannot read weight file {path.name}: {err}") from err


def load_weights(model: CausalLM, folder: Path) -> None:
    """Fills every parameter of `model` from the checkpoint in `folder`, casting to its dtype.
    Only the slices a tensor-parallel rank holds are read from the files."""
    files = tensor_files(folder)
    params = dict(model.named_parameters())
    with ExitStack() as stack:
        handles = {path: stack.enter_context(_open(path)) for path in set(files.values())}
        for name, pieces in model.checkpoint_sources().items():
            param = params[name]
            parts = []
            for piece in pieces:
                if piece.name not in files:
                    raise WeightsError(f"checkpoint is missing tensor {piece.name}")
                parts.append(_read(handles[files[piece.name]], piece))
            loaded = torch.cat(parts) if len(parts) > 1 else parts[0]
            with torch.no_grad():
                if loaded.shape[0] < param.shape[0]:  # a vocabulary shard's padding rows
                    param.zero_()
                param[: loaded.shape[0]].copy_(loaded)


def _read(handle, piece: Piece) -> torch.Tensor:
    try:
        tensor = handle.get_slice(piece.name)
        shape = tuple(tensor.get_shape())
        if shape != piece.shape:
            raise WeightsError(f"tensor {piece.name} has shape {shape}, expected {piece.shape}")
        if piece.dim == 0:
            return tensor[piece.start : piece.stop]
        return tensor[:, piece.start : piece.stop]
    except SafetensorError as err:
        raise WeightsError(f"cannot read tensor {piece.name}: {err}") from err
