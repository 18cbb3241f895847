"""Decode steps replayed from CUDA graphs, one graph per (batch, context) bucket.

On a GPU a small model's decode step is mostly kernel launches: ~12 per layer, each costing the
CPU more than the GPU (the first H200 run, a 0.5B model at 16 rows: a 12 ms step with the GPU
nearly idle). A graph captured once replays all of a step's launches as one.

A graph fixes every shape and address, so a decode step is padded up to the nearest bucket:
rows to the next batch size of `batch_buckets`, block tables to the next width of
`context_buckets`. The step's ids, positions, slots and context lengths are copied into static
buffers the graph reads; padding rows decode token 0 at position 0 into the padding block (a
block past the ones the block manager hands out, engine/kv_cache.py), over a context of one
token, so they touch nothing real. Steps a graph cannot hold (prefill chunks, layer hooks,
tensor-parallel ranks, more rows or a longer context than the largest bucket) run eagerly.

With `capture=False` (the CPU, tests) the same padded buffers run through the model eagerly:
the padding, not the capture, is what could change a real row's tokens, and that is checked
where no GPU is.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from engine.forward_batch import ForwardBatch, pad_tables

log = logging.getLogger(__name__)

# Rows per graph: every size up to 4, then steps of 8 to 64, of 16 to 256, of 32 beyond.
SMALL_BATCHES = (1, 2, 4)
# Context tokens per graph (the widest block table it holds); longer steps run eagerly.
CONTEXT_BUCKETS = (512, 2048, 8192)


def batch_buckets(max_batch: int) -> list[int]:
    sizes, size = [s for s in SMALL_BATCHES if s < max_batch], 8
    while size < max_batch:
        sizes.append(size)
        size += 8 if size < 64 else 16 if size < 256 else 32
    return [*sizes, max_batch]


def context_buckets(max_context: int) -> list[int]:
    last = min(max_context, CONTEXT_BUCKETS[-1])
    return [c for c in CONTEXT_BUCKETS if c < last] + [last]


class DecodeGraphs:
    """The decode-only steps of one model runner (tensor parallel size 1)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        block_size: int,
        max_batch: int,
        max_context: int,
        pad_block: int,  # a cache block no sequence holds: padding rows write here
        capture: bool,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.pad_block = block_size, pad_block
        self.batches = batch_buckets(max_batch)
        self.widths = [-(-c // block_size) for c in context_buckets(max_context)]
        device = kv_caches[0][0].device
        rows = self.batches[-1]
        # ids, positions, slots, context lengths: one buffer, so one copy a step fills them
        self.inputs = torch.zeros((4, rows), dtype=torch.int64, device=device)
        self.tables = {
            w: torch.full((rows, w), pad_block, dtype=torch.int64, device=device)
            for w in self.widths
        }
        self.logits_indices = torch.arange(rows, dtype=torch.int64, device=device)
        # Every graph leaves its logits here, so one [rows, vocab] buffer serves them all (made
        # by the first forward pass, outside any capture).
        self.logits: torch.Tensor | None = None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pad()
        if capture:
            self._capture_all()

    def fits(self, num_rows: int, tables: list[list[int]], has_prefills: bool) -> bool:
        """True for a decode-only step a bucket holds."""
        if has_prefills or not 0 < num_rows <= self.batches[-1] or num_rows != len(tables):
            return False
        return max(len(t) for t in tables) <= self.widths[-1]

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        context_lens: list[int],
    ) -> torch.Tensor:  # [rows, vocab] logits of every row, in order
        n = len(input_ids)
        rows = self.batches[bisect.bisect_left(self.batches, n)]
        width = self.widths[bisect.bisect_left(self.widths, max(len(t) for t in tables))]
        pad = rows - n
        pad_slot = self.pad_block * self.block_size
        inputs = torch.tensor(
            [
                [*input_ids, *[0] * pad],
                [*positions, *[0] * pad],
                [*slots, *[pad_slot] * pad],
                [*context_lens, *[1] * pad],
            ],
            dtype=torch.int64,
        )
        padded = pad_tables(tables, width, self.pad_block, rows)
        self.inputs[:, :rows].copy_(inputs)
        self.tables[width][:rows].copy_(torch.from_numpy(padded))
        graph = self.graphs.get((rows, width))
        if graph is None:  # not captured (capture=False): the same padded step, eagerly
            self._forward(rows, width)
        else:
            graph.replay()
        return self.logits[:n]

    def _forward(self, rows: int, width: int) -> None:
        """One padded step, its logits into `self.logits`: what each graph holds."""
        logits = self.model(self._batch(rows, width), self.kv_caches)
        if self.logits is None:
            self.logits = logits.new_empty((self.batches[-1], logits.shape[1]))
        self.logits[:rows].copy_(logits)

    def _batch(self, rows: int, width: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.inputs[0, :rows],
            positions=self.inputs[1, :rows],
            slot_mapping=self.inputs[2, :rows],
            num_decodes=rows,
            decode_block_tables=self.tables[width][:rows],
            decode_context_lens=self.inputs[3, :rows],
            prefills=(),
            logits_indices=self.logits_indices[:rows],
        )

    def _pad(self) -> None:
        """Every row a padding row: what the graphs run on while they are captured."""
        self.inputs[0:2].zero_()
        self.inputs[2].fill_(self.pad_block * self.block_size)
        self.inputs[3].fill_(1)
        for table in self.tables.values():
            table.fill_(self.pad_block)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Largest first, all in one memory pool: a smaller graph's temporaries fit in the
        memory a larger one freed, and the logits of all go to one buffer (per-graph outputs
        would hold rows x vocabulary each: gigabytes at 256 rows of a 150k vocabulary)."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for width in reversed(self.widths):
            for rows in reversed(self.batches):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # compiles the kernels and warms cuBLAS
                    self._forward(rows, width)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(rows, width)
                self.graphs[(rows, width)] = graph
        torch.cuda.synchronize()
        log.info(
            "captured %d decode graphs in %.1f s: up to %d rows, %d tokens of context",
            len(self.graphs), time.perf_counter() - started, self.batches[-1],
            self.widths[-1] * self.block_size,
        )  # fmt: skip
