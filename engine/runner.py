"""ModelRunner: turns a StepPlan into tensors and runs the model. The only tensor owner.

Under tensor parallelism rank 0's runner also sends each step's batch to the follower ranks
(engine/tensor_parallel.py), whose runners build the same tensors from it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed import ProcessGroup

from engine.block_manager import slots_of
from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.forward_batch import ForwardBatch, PrefillSegment, pad_tables
from engine.kv_cache import allocate_kv_cache
from engine.model import CausalLM, LayerHook
from engine.packed_linear import can_pack, pack_linears
from engine.parallel import Collectives, TPShard, shard_for
from engine.scheduler import ScheduledChunk, StepPlan
from engine.sequence import Sequence
from engine.tensor_parallel import BatchSpec, FollowerSpec, Launcher, RankGroup, spawn_followers
from engine.weights import load_weights
from kernels import cpu_extension


def load_model(
    model_cfg: ModelConfig,
    dtype: torch.dtype,
    device: str,
    shard: TPShard | None = None,
    comm: Collectives | None = None,
) -> CausalLM:
    """`shard`: a tensor-parallel rank's part, `comm` its collectives; the whole model when
    None."""
    with torch.device("meta"):
        model = CausalLM(model_cfg, shard, comm)
    model = model.to_empty(device=device).to(dtype)
    model.tie_head()
    load_weights(model, model_cfg.path)
    model.rope.to(dtype, device)
    if can_pack(dtype, torch.device(device)):
        pack_linears(model, dtype)
    return model.eval()


class ModelRunner:
    def __init__(
        self,
        model_cfg: ModelConfig,
        engine_cfg: EngineConfig,
        num_blocks: int,
        launch: Launcher | None = None,  # starts the follower ranks; local processes if None
        rank: int = 0,
        group: ProcessGroup | None = None,  # a follower's, joined by the caller
    ) -> None:
        self.dtype = getattr(torch, engine_cfg.dtype)
        self.device = torch.device(engine_cfg.device)
        self.block_size = engine_cfg.block_size
        size = engine_cfg.tensor_parallel_size
        self.shard = shard_for(model_cfg, size, rank)
        self.ranks: RankGroup | None = None
        if rank == 0 and size > 1:  # followers load their shards while this rank loads its own
            self.ranks = RankGroup(engine_cfg, num_blocks, launch or spawn_followers)
            group = self.ranks.join(self.device)
        if self.device.type == "cpu":
            # Build or load the C++ kernels now, not inside the first request (a first build
            # takes minutes, and a worker must not stall a transfer on it).
            cpu_extension.load()
        comm = Collectives(size, group)
        self.model = load_model(model_cfg, self.dtype, engine_cfg.device, self.shard, comm)
        self.kv_caches = allocate_kv_cache(
            model_cfg, num_blocks, self.block_size, self.dtype, self.device, self.shard
        )
        if self.ranks is not None:
            self.ranks.wait_ready()
        self.graphs: DecodeGraphs | None = None
        if engine_cfg.cuda_graphs and self.device.type == "cuda" and size == 1:
            self.graphs = self.decode_graphs(model_cfg, engine_cfg, num_blocks, capture=True)

    def decode_graphs(
        self, model_cfg: ModelConfig, engine_cfg: EngineConfig, num_blocks: int, capture: bool
    ) -> DecodeGraphs:
        """Graphs for every decode step this engine can run: up to max_num_seqs rows, over up
        to its longest context (padding rows write to block `num_blocks`)."""
        max_context = min(
            engine_cfg.max_model_len or model_cfg.max_model_len, num_blocks * self.block_size
        )
        return DecodeGraphs(
            self.model, self.kv_caches, block_size=self.block_size,
            max_batch=engine_cfg.max_num_seqs, max_context=max_context, pad_block=num_blocks,
            capture=capture,
        )  # fmt: skip

    @classmethod
    def follower(cls, spec: FollowerSpec, group: ProcessGroup) -> ModelRunner:
        model_cfg = ModelConfig.from_pretrained(spec.config.model)
        return cls(model_cfg, spec.config, spec.num_blocks, rank=spec.rank, group=group)

    def close(self) -> None:
        """Ends the follower ranks (no-op without tensor parallelism)."""
        if self.ranks is not None:
            self.ranks.close()

    @torch.inference_mode()
    def execute(
        self, plan: StepPlan, on_layer: LayerHook | None = None, extra: object = None
    ) -> StepLogits:
        """Runs every chunk; returns the logits of the chunks with `samples` set, in plan
        order: [S, vocab], and those of the prompt positions whose next token's logprob is
        asked for (Sequence.prompt_positions). `on_layer(i)` runs once layer i's KV for the
        whole plan is in `kv_caches`; `extra` goes to the follower ranks' hooks with the
        batch."""
        chunks = order_for_batch(plan.chunks)
        spec = self.build_spec(chunks)
        if self.ranks is not None:
            self.ranks.send(spec, extra)
        sampling = [chunk for chunk in chunks if chunk.samples]
        graphs = self.graphs
        if (
            graphs is not None
            and on_layer is None
            # every row samples, none is scored: a graph's logits are those of all its rows
            and len(spec.logits_rows) == len(sampling) == len(spec.input_ids)
            and graphs.fits(len(spec.input_ids), spec.decode_tables, bool(spec.prefills))
        ):
            logits = graphs.run(
                spec.input_ids, spec.positions, spec.slots, spec.decode_tables, spec.decode_lens
            )
        else:
            logits = self.model(self.to_batch(spec), self.kv_caches, on_layer)  # `chunks` order
        prompts = _prompt_scores(chunks, logits, len(sampling))
        logits = logits[: len(sampling)]
        position = {id(chunk.seq): i for i, chunk in enumerate(sampling)}
        in_plan_order = [position[id(chunk.seq)] for chunk in plan.chunks if chunk.samples]
        if in_plan_order != list(range(len(in_plan_order))):
            logits = logits[in_plan_order]  # (every decode-only step is in order: no copy)
        return StepLogits(logits, prompts)

    @torch.inference_mode()
    def run_spec(self, spec: BatchSpec, on_layer: LayerHook | None = None) -> None:
        """A follower's step: the forward pass of rank 0's batch (rank 0 samples)."""
        self.model(self.to_batch(spec), self.kv_caches, on_layer)

    def build_spec(self, chunks: list[ScheduledChunk]) -> BatchSpec:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        scored: list[int] = []
        decode_tables: list[list[int]] = []
        prefills: list[tuple[int, int, list[int], int]] = []
        for chunk in chunks:
            seq, row = chunk.seq, len(input_ids)
            span = range(chunk.start, chunk.end)
            table = seq.block_table
            input_ids.extend(seq.token_ids[chunk.start : chunk.end])
            positions.extend(span)
            slots.extend(slots_of(table, chunk.start, chunk.end, bs))
            if chunk.samples:
                logits_rows.append(row + chunk.num_tokens - 1)
            if seq.params.prompt_logprobs is not None:  # (a decode step's rows skip the call)
                scoring = seq.prompt_positions(chunk.start, chunk.end)
                scored.extend(row + p - chunk.start for p in scoring)
            if chunk.num_tokens == 1:
                decode_tables.append(table[: -(-chunk.end // bs)])
            else:
                prefills.append((row, len(input_ids), table[: -(-chunk.end // bs)], chunk.end))
        decode_lens = [chunk.end for chunk in chunks[: len(decode_tables)]]
        return BatchSpec(
            input_ids,
            positions,
            slots,
            logits_rows + scored,  # the sampled rows first, then the prompts' scored ones
            decode_tables,
            decode_lens,
            prefills,
        )

    def to_batch(self, spec: BatchSpec) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self._tensor(spec.input_ids),
            positions=self._tensor(spec.positions),
            slot_mapping=self._tensor(spec.slots),
            num_decodes=len(spec.decode_tables),
            decode_block_tables=torch.from_numpy(pad_tables(spec.decode_tables)).to(self.device),
            decode_context_lens=self._tensor(spec.decode_lens),
            prefills=tuple(
                PrefillSegment(start, end, self._tensor(table), context_len)
                for start, end, table, context_len in spec.prefills
            ),
            logits_indices=self._tensor(spec.logits_rows),
        )

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


class PromptScores(NamedTuple):
    """Logits of one sequence's prompt positions first..first + len(logits) - 1."""

    seq: Sequence
    first: int
    logits: torch.Tensor  # [positions, vocab]


class StepLogits(NamedTuple):
    sampling: torch.Tensor  # [S, vocab], the sampling chunks in plan order
    prompts: list[PromptScores]


def _prompt_scores(
    chunks: list[ScheduledChunk], logits: torch.Tensor, row: int
) -> list[PromptScores]:
    """The prompt positions' logits, which follow the `row` sampled ones (build_spec)."""
    scores: list[PromptScores] = []
    if len(logits) == row:  # nothing scored (every step but those of such prompts)
        return scores
    for chunk in chunks:
        positions = chunk.seq.prompt_positions(chunk.start, chunk.end)
        if positions:
            scores.append(
                PromptScores(chunk.seq, positions.start, logits[row : row + len(positions)])
            )
            row += len(positions)
    return scores


def order_for_batch(chunks: tuple[ScheduledChunk, ...]) -> list[ScheduledChunk]:
    """Single-token chunks first (attended as one decode batch), then the multi-token ones."""
    return [c for c in chunks if c.num_tokens == 1] + [c for c in chunks if c.num_tokens > 1]
