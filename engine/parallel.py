"""Tensor parallelism inside one worker: which slice of the model each rank holds, and the two
collectives the forward pass needs.

Megatron-style: attention heads and MLP columns split across ranks (q|k|v and gate|up are
column-parallel, o_proj and down_proj row-parallel, each followed by one all-reduce); the
vocabulary splits into equal row ranges for the embedding and the LM head. With fewer KV heads
than ranks, each KV head is replicated on the `size // num_kv_heads` consecutive ranks whose
query heads attend to it:

    8 query heads, 2 KV heads, TP 4:   rank   0     1     2     3
                                       q     0,1   2,3   4,5   6,7
                                       kv    0     0     1     1
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.config import ModelConfig, check_splits
from protocol.kv import kv_head_range


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size`: the heads, MLP columns and vocabulary rows it holds."""

    size: int
    rank: int
    num_heads: int  # query heads here
    num_kv_heads: int  # KV heads here (replicated when the model has fewer than `size`)
    kv_head_start: int  # the model's first KV head held here
    intermediate_size: int  # MLP columns here
    vocab_rows: int  # embedding and LM head rows here (the vocabulary padded to size * rows)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    @property
    def kv_heads(self) -> range:
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)


def shard_for(cfg: ModelConfig, size: int, rank: int) -> TPShard:
    """ConfigError when the model cannot be split `size` ways."""
    check_splits(cfg, size)
    kv_heads = kv_head_range(cfg.num_kv_heads, size, rank)
    return TPShard(
        size=size,
        rank=rank,
        num_heads=cfg.num_heads // size,
        num_kv_heads=len(kv_heads),
        kv_head_start=kv_heads.start,
        intermediate_size=cfg.intermediate_size // size,
        vocab_rows=-(-cfg.vocab_size // size),
    )


def single(cfg: ModelConfig) -> TPShard:
    """The whole model on one rank."""
    return shard_for(cfg, 1, 0)


class Collectives:
    """The forward pass's collectives over the worker's own process group (no global one:
    a process may hold several engines); no-ops at size 1."""

    def __init__(self, size: int, group: dist.ProcessGroup | None = None) -> None:
        if size > 1 and group is None:
            raise ValueError("tensor parallelism needs a process group")
        self.size = size
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums each rank's partial output (after a row-parallel matmul). The sum runs in
        fp32 so a half-precision result is rounded once, as the unsplit matmul's is."""
        if self.size == 1:
            return x
        total = x.float()
        self.group.allreduce([total]).wait()
        return total.to(x.dtype)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[S, vocab_rows] from each rank -> [S, size * vocab_rows] on every rank."""
        if self.size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self.group.allgather([parts], [logits.contiguous()]).wait()
        return torch.cat(parts, dim=-1)
