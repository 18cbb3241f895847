"""ForwardBatch: the tensors of one model step, built by the runner and read by attention.

Rows are ordered decodes first, then one contiguous segment per prefill chunk:

    rows:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]
             decodes    prefill 0     prefill 1

Decodes are attended as one batch; each prefill segment is attended on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PrefillSegment:
    start: int  # first row of the chunk
    end: int  # one past its last row
    block_table: torch.Tensor  # [blocks covering context_len] int64
    context_len: int  # cached prefix + this chunk

    @property
    def is_fresh(self) -> bool:
        """True when the chunk is the whole context: attention can use its own K/V directly."""
        return self.end - self.start == self.context_len


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64
    decode_context_lens: torch.Tensor  # [num_decodes] int64
    prefills: tuple[PrefillSegment, ...]
    logits_indices: torch.Tensor  # [S] rows whose next-token logits are wanted


def pad_tables(
    tables: list[list[int]], width: int | None = None, fill: int = 0, rows: int | None = None
) -> np.ndarray:
    """[rows (default: one per table), width (default: the longest)] int64: each table's row
    padded with `fill`, which attention masks by context length, and rows past the tables all
    `fill`. Filled row by row through numpy: a nested list through torch.tensor costs ~4x as
    much, milliseconds a step at a few hundred rows."""
    if width is None:
        width = max((len(t) for t in tables), default=0)
    padded = np.full((rows or len(tables), width), fill, dtype=np.int64)
    for i, table in enumerate(tables):
        padded[i, : len(table)] = table
    return padded
