"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

The projections are fused at load time (q|k|v and gate|up) so each layer runs four matmuls;
`checkpoint_sources` says which checkpoint tensors fill each fused parameter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.rope import RotaryEmbedding
from kernels import ops

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: key_cache, value_cache
LayerHook = Callable[[int], None]


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
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
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
        return self.o_proj(out.reshape(-1, self.q_size))

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
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

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
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(h))), residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
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
        x = self.embed_tokens(batch.input_ids)
        residual = None
        rope = self.rope.lookup(batch.positions)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, batch, kv_cache, rope)
            if on_layer is not None:
                on_layer(i)
        rows = batch.logits_indices
        x, _ = self.norm.add_and_norm(x[rows], residual[rows])
        return self.lm_head(x)

    def checkpoint_sources(self) -> dict[str, list[tuple[str, int]]]:
        """Our parameter -> (checkpoint tensor, its rows): the tensors concatenated on dim 0."""
        cfg = self.cfg
        embed = "model.embed_tokens.weight"
        sources = {
            "embed_tokens.weight": [(embed, cfg.vocab_size)],
            "norm.weight": [("model.norm.weight", cfg.hidden_size)],
            "lm_head.weight": [
                (embed if cfg.tie_word_embeddings else "lm_head.weight", cfg.vocab_size)
            ],
        }
        for i in range(cfg.num_layers):
            sources.update(_layer_sources(i, cfg))
        return sources


def _layer_sources(i: int, cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    ours, theirs = f"layers.{i}.", f"model.layers.{i}."
    attn, mlp = theirs + "self_attn.", theirs + "mlp."
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv = [("q", q_rows), ("k", kv_rows), ("v", kv_rows)]
    sources = {
        ours + "input_norm.weight": [(theirs + "input_layernorm.weight", cfg.hidden_size)],
        ours + "post_attn_norm.weight": [
            (theirs + "post_attention_layernorm.weight", cfg.hidden_size)
        ],
        ours + "attn.qkv_proj.weight": [(f"{attn}{p}_proj.weight", n) for p, n in qkv],
        ours + "attn.o_proj.weight": [(attn + "o_proj.weight", cfg.hidden_size)],
        ours + "gate_up_proj.weight": [
            (mlp + "gate_proj.weight", cfg.intermediate_size),
            (mlp + "up_proj.weight", cfg.intermediate_size),
        ],
        ours + "down_proj.weight": [(mlp + "down_proj.weight", cfg.hidden_size)],
    }
    if cfg.qkv_bias:
        sources[ours + "attn.qkv_proj.bias"] = [(f"{attn}{p}_proj.bias", n) for p, n in qkv]
    if cfg.qk_norm:
        sources[ours + "attn.q_norm.weight"] = [(attn + "q_norm.weight", cfg.head_dim)]
        sources[ours + "attn.k_norm.weight"] = [(attn + "k_norm.weight", cfg.head_dim)]
    return sources
