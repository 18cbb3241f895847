"""The KV transfer cost model: seconds to send one layer's KV as a fixed cost plus one per byte."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from planning.model_file import FORMAT_VERSION, CostModelError, check_kind, load_json, save_json
from planning.nnls import FitStats, fit_relative, mean_abs_pct

TRANSFER_MODEL_KIND = "tandem.transfer_cost_model"


@dataclass(frozen=True)
class TransferCostModel:
    """One layer of one request's KV: `base_seconds` (a message, a wake-up) plus bytes / bandwidth.
    Both terms are >= 0: a transfer never gets faster for being bigger."""

    base_seconds: float
    seconds_per_byte: float
    stats: FitStats
    transport: str = ""

    def predict(self, num_bytes: int) -> float:
        return self.base_seconds + self.seconds_per_byte * num_bytes

    @classmethod
    def fit(
        cls,
        samples: Sequence[tuple[int, float]],
        heldout: Sequence[tuple[int, float]] = (),
        transport: str = "",
    ) -> TransferCostModel:
        """From (bytes, seconds) pairs; `heldout` pairs only score it."""
        if not samples:
            raise CostModelError("no transfer measurements to fit")
        sizes, seconds = (np.array(column, dtype=float) for column in zip(*samples, strict=True))
        coef = fit_relative(np.stack([np.ones_like(sizes), sizes], axis=1), seconds)
        model = cls(float(coef[0]), float(coef[1]), FitStats(len(samples), 0.0, 0, None), transport)
        heldout_mae = _mae(model, heldout) if heldout else None
        stats = FitStats(len(samples), _mae(model, samples), len(heldout), heldout_mae)
        return dataclasses.replace(model, stats=stats)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": TRANSFER_MODEL_KIND,
            "version": FORMAT_VERSION,
            "base_seconds": self.base_seconds,
            "seconds_per_byte": self.seconds_per_byte,
            "stats": self.stats._asdict(),
            "transport": self.transport,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TransferCostModel:
        check_kind(data, TRANSFER_MODEL_KIND)
        try:
            return cls(
                float(data["base_seconds"]),
                float(data["seconds_per_byte"]),
                FitStats(**data["stats"]),
                str(data["transport"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CostModelError(f"not a transfer cost model: {err!r}") from None

    def save(self, path: Path) -> None:
        save_json(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> TransferCostModel:
        return cls.from_json(load_json(path))


def _mae(model: TransferCostModel, samples: Sequence[tuple[int, float]]) -> float:
    predicted = np.array([model.predict(size) for size, _ in samples])
    return mean_abs_pct(predicted, np.array([seconds for _, seconds in samples], dtype=float))
