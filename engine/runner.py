"""ModelRunner: turns a StepPlan into tensors, runs the model, samples. The only tensor owner."""

from __future__ import annotations

import torch

from engine.block_manager import slots_of
from engine.config import EngineConfig, ModelConfig
from engine.forward_batch import ForwardBatch, PrefillSegment
from engine.kv_cache import allocate_kv_cache
from engine.model import CausalLM, LayerHook
from engine.packed_linear import can_pack, pack_linears
from engine.scheduler import ScheduledChunk, StepPlan
from engine.weights import load_weights
from kernels import cpu_extension


def load_model(model_cfg: ModelConfig, dtype: torch.dtype, device: str) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(model_cfg)
    model = model.to_empty(device=device).to(dtype)
    load_weights(model, model_cfg.path)
    model.rope.to(dtype, device)
    if can_pack(dtype, torch.device(device)):
        pack_linears(model, dtype)
    return model.eval()


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, num_blocks: int) -> None:
        self.dtype = getattr(torch, engine_cfg.dtype)
        self.device = torch.device(engine_cfg.device)
        self.block_size = engine_cfg.block_size
        if self.device.type == "cpu":
            # Build or load the C++ kernels now, not inside the first request (a first build
            # takes minutes, and a worker must not stall a transfer on it).
            cpu_extension.load()
        self.model = load_model(model_cfg, self.dtype, engine_cfg.device)
        self.kv_caches = allocate_kv_cache(
            model_cfg, num_blocks, self.block_size, self.dtype, self.device
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan, on_layer: LayerHook | None = None) -> torch.Tensor:
        """Runs every chunk; returns the logits of the chunks with `samples` set, in plan
        order: [S, vocab]. `on_layer(i)` runs once layer i's KV for the whole plan is in
        `kv_caches`."""
        chunks = order_for_batch(plan.chunks)
        batch = self.build_batch(chunks)
        logits = self.model(batch, self.kv_caches, on_layer)  # rows in `chunks` order
        sampling = [chunk for chunk in chunks if chunk.samples]
        position = {id(chunk.seq): i for i, chunk in enumerate(sampling)}
        in_plan_order = [position[id(chunk.seq)] for chunk in plan.chunks if chunk.samples]
        return logits[in_plan_order]

    def build_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        decode_tables: list[list[int]] = []
        prefills: list[PrefillSegment] = []
        for chunk in chunks:
            seq, row = chunk.seq, len(input_ids)
            span = range(chunk.start, chunk.end)
            table = seq.block_table
            input_ids.extend(seq.token_ids[chunk.start : chunk.end])
            positions.extend(span)
            slots.extend(slots_of(table, chunk.start, chunk.end, bs))
            if chunk.samples:
                logits_rows.append(row + chunk.num_tokens - 1)
            if chunk.num_tokens == 1:
                decode_tables.append(table[: -(-chunk.end // bs)])
            else:
                used = table[: -(-chunk.end // bs)]
                block_table = torch.tensor(used, dtype=torch.int64, device=self.device)
                prefills.append(PrefillSegment(row, len(input_ids), block_table, chunk.end))
        decode_lens = [chunk.end for chunk in chunks[: len(decode_tables)]]
        return ForwardBatch(
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            slot_mapping=self._tensor(slots),
            num_decodes=len(decode_tables),
            decode_block_tables=self._tensor(pad_tables(decode_tables)),
            decode_context_lens=self._tensor(decode_lens),
            prefills=tuple(prefills),
            logits_indices=self._tensor(logits_rows),
        )

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def order_for_batch(chunks: tuple[ScheduledChunk, ...]) -> list[ScheduledChunk]:
    """Single-token chunks first (attended as one decode batch), then the multi-token ones."""
    return [c for c in chunks if c.num_tokens == 1] + [c for c in chunks if c.num_tokens > 1]


def pad_tables(tables: list[list[int]]) -> list[list[int]]:
    # Padding entries point at block 0; attention masks them by context length.
    width = max((len(t) for t in tables), default=0)
    return [t + [0] * (width - len(t)) for t in tables]
