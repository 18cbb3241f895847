"""The per-step cost model: an engine step's measured seconds as a sum of non-negative terms.

A `StepCostModel` predicts one engine step's wall time from its shape (the four shape fields of
`protocol.telemetry.StepRecord`). The terms, each a feature times a fitted coefficient:

  step               1                      scheduling, sampling setup, per-layer launches
  small_batch_rows   min(rows, S)           per-row cost while rows <= S (S = small_batch_rows)
  large_batch        1 if rows > S          the jump where linears change kernel
  large_batch_rows   max(rows - S, 0)       per-row cost above S
  rows_over_knee     max(rows - K, 0)       extra per-row cost once linears turn compute-bound
  prefill_step       1 if any prompt chunk  the prompt-attention path's fixed cost
  decode_seqs        decoding sequences     sampling, lm_head row, one attention call each
  decode_context     sum of their contexts  decode attention reads every cached token
  prefill_attention  sum tokens x context   prompt attention is quadratic in the chunk
  cached_attention   tokens x cached prefix the dearer attention path after a cached prefix

rows = prefill_tokens + decode_seqs, the linears' batch. Why the row terms are piecewise: on CPU,
bf16 linears run a hand-written AMX kernel for up to 16 rows and oneDNN above
(engine/packed_linear.py). Measured on SmolLM2-135M (2 cores): 16 rows take ~16 ms and 17 rows
~21 ms, a step no straight line in rows can follow; above 17 rows the cost per row grows again
past ~128 rows, where the weights stop being the bottleneck (0.15 ms/row below, 0.24 above).
The knee K is chosen by the fit among powers of two; on GPUs the jump's coefficient simply fits
to about 0.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from planning.model_file import FORMAT_VERSION, CostModelError, check_kind, load_json, save_json
from planning.nnls import FitStats, fit_relative, mean_abs_pct

STEP_MODEL_KIND = "tandem.step_cost_model"
SMALL_BATCH_ROWS = 16  # engine/packed_linear.py's AMX_MAX_ROWS; not imported: no torch here
KNEE_CANDIDATES = (32, 64, 128, 256, 512, 1024)


class StepShape(NamedTuple):
    """What a step computes; `StepRecord` carries the same four fields."""

    prefill_tokens: int
    prefill_attention: int
    decode_seqs: int
    decode_context: int


class HasStepShape(Protocol):
    prefill_tokens: int
    prefill_attention: int
    decode_seqs: int
    decode_context: int


class TimedStep(HasStepShape, Protocol):
    seconds: float


@dataclass(frozen=True)
class ProfileInfo:
    """Where the measurements came from; a model fits only the setup it was measured on."""

    model: str = ""
    dtype: str = ""
    device: str = ""
    threads: int = 0
    block_size: int = 0
    source: str = ""  # "sweep" or "telemetry"
    others_cores: float | None = None  # CPU other processes took during a sweep: its noise
    host: str = ""  # the machine the steps ran on (a cluster's sweep runs on a worker node)
    tensor_parallel: int = 1  # ranks each step ran on


Feature = Callable[[HasStepShape, int, int], float]  # (shape, small_batch_rows, knee) -> value


def _rows(s: HasStepShape) -> int:
    return s.prefill_tokens + s.decode_seqs


FEATURES: dict[str, Feature] = {
    "step": lambda s, small, knee: 1.0,
    "small_batch_rows": lambda s, small, knee: min(_rows(s), small),
    "large_batch": lambda s, small, knee: float(_rows(s) > small),
    "large_batch_rows": lambda s, small, knee: max(_rows(s) - small, 0),
    "rows_over_knee": lambda s, small, knee: max(_rows(s) - knee, 0),
    "prefill_step": lambda s, small, knee: float(s.prefill_tokens > 0),
    "decode_seqs": lambda s, small, knee: s.decode_seqs,
    "decode_context": lambda s, small, knee: s.decode_context,
    "prefill_attention": lambda s, small, knee: s.prefill_attention,
    "cached_attention": lambda s, small, knee: _cached_attention(s),
}


def _cached_attention(s: HasStepShape) -> int:
    """Prompt attention against a cached prefix: new tokens x cached tokens, summed over chunks.

    A fresh prompt chunk runs causal SDPA on its own K/V (flash on CPU and GPU: half of tokens x
    context, and fast); a chunk after a cached prefix gathers the paged cache and runs masked
    attention over all of it, measured ~10x dearer per unit. The record sums T x (cached + T)
    over chunks; minus (sum of T)^2 that is exactly T x cached for one chunk, and 0 (clipped)
    for any number of fresh chunks, the two cases serving mostly sees."""
    return max(s.prefill_attention - s.prefill_tokens**2, 0)


@dataclass(frozen=True)
class StepCostModel:
    features: tuple[str, ...]
    coefficients: tuple[float, ...]  # seconds per unit of the feature of the same index
    small_batch_rows: int
    knee_rows: int
    stats: FitStats
    info: ProfileInfo = ProfileInfo()

    def predict(self, shape: HasStepShape) -> float:
        """Seconds one step of this shape takes: the terms summed in feature order (so that
        `predict_decodes` can give the same number to the last bit)."""
        total = 0.0
        for coefficient, value in zip(self.coefficients, self._row(shape), strict=True):
            total += coefficient * value
        return total

    def predict_decodes(self, num_seqs: int, contexts: np.ndarray) -> np.ndarray:
        """`predict` of a decode step of `num_seqs` sequences for each total context in
        `contexts`, bit for bit, at once (the simulator's leaps: only the context changes)."""
        row = self._row(StepShape(0, 0, num_seqs, 0))
        total = np.zeros(len(contexts))
        for name, coefficient, value in zip(self.features, self.coefficients, row, strict=True):
            total += coefficient * (contexts if name == "decode_context" else value)
        return total

    def predict_many(self, shapes: Sequence[HasStepShape]) -> np.ndarray:
        return _matrix(shapes, self.features, self.small_batch_rows, self.knee_rows) @ np.array(
            self.coefficients
        )

    def _row(self, shape: HasStepShape) -> list[float]:
        return [FEATURES[f](shape, self.small_batch_rows, self.knee_rows) for f in self.features]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": STEP_MODEL_KIND,
            "version": FORMAT_VERSION,
            "coefficients": dict(zip(self.features, self.coefficients, strict=True)),
            "small_batch_rows": self.small_batch_rows,
            "knee_rows": self.knee_rows,
            "stats": self.stats._asdict(),
            "info": dataclasses.asdict(self.info),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepCostModel:
        check_kind(data, STEP_MODEL_KIND)
        try:
            coefficients: dict[str, float] = data["coefficients"]
            unknown = set(coefficients) - set(FEATURES)
            if unknown:
                raise CostModelError(f"unknown cost features: {', '.join(sorted(unknown))}")
            bad = [n for n, c in coefficients.items() if not 0 <= float(c) < math.inf]
            if bad:  # (NaN fails too) a fit never gives these: a hand-edited file does
                raise CostModelError(
                    f"cost coefficients must be finite and >= 0: {', '.join(sorted(bad))}"
                )
            return cls(
                tuple(coefficients),
                tuple(float(c) for c in coefficients.values()),
                int(data["small_batch_rows"]),
                int(data["knee_rows"]),
                FitStats(**data["stats"]),
                ProfileInfo(**data["info"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CostModelError(f"not a step cost model: {err!r}") from None

    def save(self, path: Path) -> None:
        save_json(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> StepCostModel:
        return cls.from_json(load_json(path))


class CostModel(Protocol):
    def predict(self, shape: HasStepShape) -> float: ...


@dataclass
class Calibrated:
    """A profile scaled by how the live engine's steps compare with it: a profile measured with
    other threads, another clock or a busier machine is off by a near-constant factor, which
    the recent steps tell (each `observe` moves the factor part of the way, clipped so that a
    few odd steps cannot swing it far)."""

    model: StepCostModel
    factor: float = 1.0
    weight: float = 0.3  # how far one batch of steps moves the factor
    bounds: tuple[float, float] = (0.25, 4.0)

    def predict(self, shape: HasStepShape) -> float:
        return self.factor * self.model.predict(shape)

    def observe(self, steps: Sequence[TimedStep]) -> None:
        if not steps:
            return
        predicted = float(self.model.predict_many(steps).sum())
        if predicted <= 0:
            return
        ratio = sum(s.seconds for s in steps) / predicted
        moved = self.factor + self.weight * (ratio - self.factor)
        self.factor = min(max(moved, self.bounds[0]), self.bounds[1])


def fit(
    train: Sequence[TimedStep],
    heldout: Sequence[TimedStep] = (),
    info: ProfileInfo = ProfileInfo(),
    small_batch_rows: int = SMALL_BATCH_ROWS,
) -> StepCostModel:
    """The model with every feature, its knee the candidate that fits `train` best; `heldout`
    only scores it."""
    if not train:
        raise CostModelError("no step measurements to fit")
    seconds = np.array([r.seconds for r in train], dtype=float)
    fits = [_fit_knee(train, seconds, small_batch_rows, k) for k in _knees(train, small_batch_rows)]
    _, model = min(fits, key=lambda pair: pair[0])
    heldout_mae = mean_abs_pct_error(model, heldout) if heldout else None
    stats = model.stats._replace(num_heldout=len(heldout), heldout_mae_pct=heldout_mae)
    return dataclasses.replace(model, stats=stats, info=info)


def _fit_knee(
    train: Sequence[HasStepShape], seconds: np.ndarray, small_batch_rows: int, knee: int
) -> tuple[float, StepCostModel]:
    """(sum of squared relative errors, the model) with the knee at `knee` rows."""
    features = tuple(FEATURES)
    a = _matrix(train, features, small_batch_rows, knee)
    coef = fit_relative(a, seconds)
    stats = FitStats(len(train), mean_abs_pct(a @ coef, seconds), 0, None)
    model = StepCostModel(features, tuple(float(c) for c in coef), small_batch_rows, knee, stats)
    return float(np.sum(((a @ coef) / seconds - 1) ** 2)), model


def _knees(train: Sequence[HasStepShape], small_batch_rows: int) -> list[int]:
    """Candidate knees with measurements on both sides; the largest candidate when none has."""
    rows = [_rows(r) for r in train]
    inside = [k for k in KNEE_CANDIDATES if k > small_batch_rows and min(rows) < k < max(rows)]
    return inside or [KNEE_CANDIDATES[-1]]


def _matrix(
    shapes: Sequence[HasStepShape], features: Sequence[str], small: int, knee: int
) -> np.ndarray:
    """[len(shapes), len(features)]"""
    return np.array([[FEATURES[f](s, small, knee) for f in features] for s in shapes], dtype=float)


def mean_abs_pct_error(model: StepCostModel, records: Sequence[TimedStep]) -> float:
    """Mean |predicted - measured| / measured over `records`, in percent."""
    seconds = np.array([r.seconds for r in records], dtype=float)
    return mean_abs_pct(model.predict_many(records), seconds)
