"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

The projections are fused at load time (q|k|v and gate|up) so each layer runs four matmuls;
`checkpoint_sources` says which checkpoint tensors (and which slice of each, under tensor
parallelism: engine/parallel.py) fill each parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.parallel import Collectives, TPShard, single
from engine.rope import RotaryEmbedding
from kernels import ops

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: key_cache, value_cache
LayerHook = Callable[[int], None]


class Piece(NamedTuple):
    """Rows or columns [start, stop) along `dim` of checkpoint tensor `name`, whose full
    shape is `shape`."""

    name: str
    shape: tuple[int, ...]
    dim: int
    start: int
    stop: int


def whole(name: str, *shape: int) -> Piece:
    return Piece(name, shape, 0, 0, shape[0])


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        if x.dim() == 2:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this norm of x + residual, x + residual); [N, size]
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """This rank's heads: column-parallel q|k|v, row-parallel o_proj, then one all-reduce."""

    def __init__(self, cfg: ModelConfig, shard: TPShard, comm: Collectives) -> None:
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = (
            shard.num_heads,
            shard.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = shard.num_heads * cfg.head_dim
        self.kv_size = shard.num_kv_heads * cfg.head_dim
        self.comm = comm
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin of the batch's positions
    ) -> torch.Tensor:  # [N, hidden]
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.kv_heads, self.head_dim)
        heads = self.num_heads + self.kv_heads
        if self.q_norm is None:  # q and k heads sit side by side: one rotary call for both
            qk = ops.rotary(qkv[:, :heads], *rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q = ops.rotary(self.q_norm(qkv[:, : self.num_heads]), *rope)
            k = ops.rotary(self.k_norm(qkv[:, self.num_heads : heads]), *rope)
        v = qkv[:, heads:]
        ops.store_kv(k, v, kv_cache[0], kv_cache[1], batch.slot_mapping)
        out = self._attend(q, k, v, batch, kv_cache)
        return self.comm.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))

    def _attend(
        self,
        q: torch.Tensor,  # [N, num_heads, head_dim]
        k: torch.Tensor,  # [N, kv_heads, head_dim]
        v: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:  # [N, num_heads, head_dim]
        key_cache, value_cache = kv_cache
        nd = batch.num_decodes
        if nd == q.shape[0]:  # decode-only step: no output buffer to assemble
            return ops.decode_attention(
                q, key_cache, value_cache, batch.decode_block_tables, batch.decode_context_lens,
                self.scale,
            )  # fmt: skip
        out = torch.empty_like(q)
        if nd:
            out[:nd] = ops.decode_attention(
                q[:nd],
                key_cache,
                value_cache,
                batch.decode_block_tables,
                batch.decode_context_lens,
                self.scale,
            )
        for seg in batch.prefills:
            rows = slice(seg.start, seg.end)
            if seg.is_fresh:
                out[rows] = ops.causal_attention(q[rows], k[rows], v[rows], self.scale)
            else:
                out[rows] = ops.prefill_attention(
                    q[rows], key_cache, value_cache, seg.block_table, seg.context_len, self.scale
                )
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard, comm: Collectives) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, shard, comm)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * shard.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shard.intermediate_size, cfg.hidden_size, bias=False)
        self.comm = comm

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]: the previous layer's output, or the embeddings
        residual: torch.Tensor | None,  # the residual stream before x is added; None at layer 0
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # this layer's output, the residual stream
        """The residual adds ride in the norms that follow them (one pass each on CPU and CUDA),
        rounded exactly as `residual + x` would be."""
        if residual is None:
            h, residual = self.input_norm(x), x
        else:
            h, residual = self.input_norm.add_and_norm(x, residual)
        h = self.attn(h, batch, kv_cache, rope)
        h, residual = self.post_attn_norm.add_and_norm(h, residual)
        h = self.down_proj(ops.silu_and_mul(self.gate_up_proj(h)))
        return self.comm.all_reduce(h), residual


class CausalLM(nn.Module):
    """One rank's part of the model (the whole of it at tensor parallel size 1). Every rank
    runs `forward` on the same batch; each returns the full logits."""

    def __init__(
        self, cfg: ModelConfig, shard: TPShard | None = None, comm: Collectives | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard = shard or single(cfg)
        self.comm = comm = comm or Collectives(shard.size)
        self.embed_tokens = nn.Embedding(shard.vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard, comm) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, shard.vocab_rows, bias=False)
        self.tie_head()
        with torch.device("cpu"):  # plain tables even when the module is built on "meta"
            self.rope = RotaryEmbedding(
                cfg.head_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling
            )
        self.requires_grad_(False)

    def forward(
        self, batch: ForwardBatch, kv_caches: KVCaches, on_layer: LayerHook | None = None
    ) -> torch.Tensor:
        """Runs every row; returns logits [S, vocab] (model dtype) for the logits_indices rows.
        `on_layer(i)` runs as soon as layer i has written its KV and produced its output."""
        x = self._embed(batch.input_ids)
        residual = None
        rope = self.rope.lookup(batch.positions)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, batch, kv_cache, rope)
            if on_layer is not None:
                on_layer(i)
        rows = batch.logits_indices
        x, _ = self.norm.add_and_norm(x[rows], residual[rows])
        return self.comm.gather_vocab(self.lm_head(x))[:, : self.cfg.vocab_size]

    def tie_head(self) -> None:
        """With tied embeddings the LM head is the embedding's parameter, one matrix as in the
        checkpoint (both hold the same vocabulary rows on every rank). Moving the module to
        another device or dtype may give each its own tensor: call again after."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, hidden]
        """Vocabulary-parallel: each rank embeds the ids in its row range, zeros for the
        rest, and the all-reduce adds exactly one non-zero row per token."""
        if self.shard.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_rows)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        return self.comm.all_reduce(x.masked_fill(outside[:, None], 0))

    def checkpoint_sources(self) -> dict[str, list[Piece]]:
        """Our parameter -> the checkpoint slices concatenated on dim 0 to fill it. A
        vocabulary-split parameter may get fewer rows than it has (the padding stays zero)."""
        cfg, shard = self.cfg, self.shard
        vocab = slice(shard.vocab_start, min(cfg.vocab_size, shard.vocab_start + shard.vocab_rows))
        embed = "model.embed_tokens.weight"
        sources = {
            "embed_tokens.weight": [_rows(embed, cfg.vocab_size, cfg.hidden_size, vocab)],
            "norm.weight": [whole("model.norm.weight", cfg.hidden_size)],
        }
        if not cfg.tie_word_embeddings:  # tied: the LM head is the embedding's parameter
            head = "lm_head.weight"
            sources[head] = [_rows(head, cfg.vocab_size, cfg.hidden_size, vocab)]
        for i in range(cfg.num_layers):
            sources.update(_layer_sources(i, cfg, shard))
        return sources


def _rows(name: str, rows: int, cols: int, take: slice) -> Piece:
    return Piece(name, (rows, cols), 0, take.start, take.stop)


def _layer_sources(i: int, cfg: ModelConfig, shard: TPShard) -> dict[str, list[Piece]]:
    ours, theirs = f"layers.{i}.", f"model.layers.{i}."
    attn, mlp = theirs + "self_attn.", theirs + "mlp."
    hidden, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_rows = slice(shard.rank * shard.num_heads * hd, (shard.rank + 1) * shard.num_heads * hd)
    kv_rows = slice(shard.kv_head_start * hd, shard.kv_heads.stop * hd)
    mlp_rows = slice(
        shard.rank * shard.intermediate_size, (shard.rank + 1) * shard.intermediate_size
    )
    qkv = [("q", cfg.num_heads * hd, q_rows), *((p, cfg.num_kv_heads * hd, kv_rows) for p in "kv")]
    sources = {
        ours + "input_norm.weight": [whole(theirs + "input_layernorm.weight", hidden)],
        ours + "post_attn_norm.weight": [whole(theirs + "post_attention_layernorm.weight", hidden)],
        ours + "attn.qkv_proj.weight": [
            _rows(f"{attn}{p}_proj.weight", n, hidden, take) for p, n, take in qkv
        ],
        ours + "attn.o_proj.weight": [
            Piece(
                attn + "o_proj.weight", (hidden, cfg.num_heads * hd), 1, q_rows.start, q_rows.stop
            )
        ],
        ours + "gate_up_proj.weight": [
            _rows(mlp + "gate_proj.weight", inter, hidden, mlp_rows),
            _rows(mlp + "up_proj.weight", inter, hidden, mlp_rows),
        ],
        ours + "down_proj.weight": [
            Piece(mlp + "down_proj.weight", (hidden, inter), 1, mlp_rows.start, mlp_rows.stop)
        ],
    }
    if cfg.qkv_bias:
        sources[ours + "attn.qkv_proj.bias"] = [
            Piece(f"{attn}{p}_proj.bias", (n,), 0, take.start, take.stop) for p, n, take in qkv
        ]
    if cfg.qk_norm:
        sources[ours + "attn.q_norm.weight"] = [whole(attn + "q_norm.weight", hd)]
        sources[ours + "attn.k_norm.weight"] = [whole(attn + "k_norm.weight", hd)]
    return sources
