"""Configs: what the checkpoint says (ModelConfig) and how the engine runs it (EngineConfig).

Both are frozen. Facts discovered at run time (how many KV blocks fit) live in `engine.kv_cache`
and `engine.engine`, never written back here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A checkpoint folder or engine setting tandem cannot run."""


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    max_model_len: int

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"{folder} is not a model folder: config.json not found")
        raw = _read_json(config_file)
        if not isinstance(raw, dict):
            raise ConfigError(f"{config_file} holds no JSON object")
        try:
            return cls._from_fields(folder, raw)
        except ConfigError:
            raise
        except KeyError as err:
            raise ConfigError(f"{config_file} has no {err.args[0]!r}") from None
        except (TypeError, ValueError, ZeroDivisionError, AttributeError) as err:
            raise ConfigError(f"{config_file} is not a model we can load: {err}") from None

    @classmethod
    def _from_fields(cls, folder: Path, raw: dict) -> ModelConfig:
        architecture = _architecture(raw)
        generation = _read_json(folder / "generation_config.json", missing_ok=True)
        num_heads = raw["num_attention_heads"]
        hidden_size = raw["hidden_size"]
        for name in ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size"):
            if not isinstance(raw[name], int) or raw[name] < 1:
                raise ValueError(f"{name} must be a positive integer, not {raw[name]!r}")
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        max_positions = raw.get("max_position_embeddings", 2048)
        return cls(
            path=folder,
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            rope_scaling=_rope_scaling(raw),
            max_position_embeddings=max_positions,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=architecture == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
            qk_norm=architecture == "Qwen3ForCausalLM",
            eos_token_ids=_eos_ids(raw, generation),
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
            max_model_len=_max_model_len(raw, max_positions),
        )


# Tokens per engine step when none is given. A step holding a prefill chunk holds up every
# decode in it, so the chunk is sized for the device: on a GPU 2,048 prompt tokens take tens of
# milliseconds; on a CPU they take seconds (2-7 s on the 2-core VMs), and 256 kept more streams
# decoding (SmolLM2 @16 on a 2-core AVX-512 VM: 216 against 150 output tok/s in-process, TTFT p50
# 1.1 against 4.5 s; docs/performance.md, "The same VM kind again").
DEFAULT_BATCHED_TOKENS = {"cuda": 2048, "cpu": 256}


def default_batched_tokens(device: str) -> int:
    """The token budget of a step on `device` ("cpu", "cuda", "cuda:1") when none is given."""
    return DEFAULT_BATCHED_TOKENS.get(device.split(":")[0], DEFAULT_BATCHED_TOKENS["cuda"])


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs a model.

    The KV pool size is `num_kv_blocks` when given, else what `gpu_memory_utilization` leaves
    on a GPU when given, else whatever `kv_cache_memory_bytes` holds.
    """

    model: str | Path
    dtype: str = "bfloat16"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    # CUDA: the share of the GPU's memory this engine may hold in all (weights, activations,
    # KV); the KV pool gets what is left (engine/gpu_memory.py). None: kv_cache_memory_bytes.
    gpu_memory_utilization: float | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: default_batched_tokens(device)
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # With prefix caching: a waiting request whose next prompt block another request is
    # prefilling waits for it to be cached instead of computing it too (engine/scheduler.py).
    share_prefill: bool = True
    # A decode worker admits transferred KV only while every request it holds keeps room for
    # this many more tokens (scheduler.fits_with_headroom); 0: blocks for the prompt suffice.
    decode_headroom_tokens: int = 256
    seed: int = 0
    # The TTFT objective, when one is set: past it, waiting requests go newest first
    # (engine/scheduler.py). None: first come first served.
    late_after_s: float | None = None
    tensor_parallel_size: int = 1  # ranks (devices, or CPU cores) the model is split across
    # On CUDA, decode steps replay captured graphs (engine/cuda_graphs.py); False: every step
    # eager (`--enforce-eager`). No effect on the CPU or with tensor parallelism.
    cuda_graphs: bool = True
    rank_timeout: float = 120.0  # seconds ranks may take to start, or to meet in a collective

    def __post_init__(self) -> None:
        # The device's budget, and at least a token for each running sequence (vLLM asks as
        # much). "auto" waits until the cluster's device is known (a replace(device=...)).
        if self.max_num_batched_tokens is None and self.device != "auto":
            budget = max(default_batched_tokens(self.device), self.max_num_seqs)
            object.__setattr__(self, "max_num_batched_tokens", budget)
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype must be bfloat16, float16 or float32, not {self.dtype!r}")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
        ):
            value = getattr(self, name)  # (a budget still None waits for the device)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.decode_headroom_tokens < 0:
            raise ConfigError("decode_headroom_tokens must be at least 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError("num_kv_blocks must be at least 1")
        share = self.gpu_memory_utilization
        if share is not None and not 0 < share <= 1:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.late_after_s is not None and self.late_after_s <= 0:
            raise ConfigError("late_after_s must be above 0")


def _read_json(path: Path, missing_ok: bool = False) -> dict[str, Any]:
    if missing_ok and not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read {path}: {err}") from err


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    found = ", ".join(names) or raw.get("model_type", "unknown")
    raise ConfigError(f"unsupported architecture {found}; tandem supports {supported}")


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 nests theta and scaling under rope_parameters; older files keep them flat.
    return raw.get("rope_parameters") or raw.get("rope_scaling") or {}


def _rope_theta(raw: dict[str, Any]) -> float:
    return float(raw.get("rope_theta") or _rope_params(raw).get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling:
    params = _rope_params(raw)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"unsupported rope scaling {rope_type!r}; tandem supports "
            + ", ".join(SUPPORTED_ROPE_TYPES)
        )
    if rope_type == "default":
        return RopeScaling()
    return RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def _max_model_len(raw: dict[str, Any], max_positions: int) -> int:
    # Attention here is full-context; a sliding window shorter than the position limit caps the
    # context instead, so every position we serve attends exactly as the checkpoint expects.
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", window is not None)
    if window and uses_window and window < max_positions:
        return int(window)
    return int(max_positions)


def check_splits(cfg: ModelConfig, size: int) -> None:
    """ConfigError unless the model splits `size` ways (heads, KV heads, MLP width)."""
    if size < 1:
        raise ConfigError("tensor_parallel_size must be at least 1")
    problems = []
    if cfg.num_heads % size:
        problems.append(f"its {cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"its {cfg.num_kv_heads} KV heads (nor is {size} a multiple of them)")
    if cfg.intermediate_size % size:
        problems.append(f"its MLP width {cfg.intermediate_size}")
    if problems:
        raise ConfigError(f"tensor parallel size {size} does not divide " + " or ".join(problems))
