"""When each request is sent. Gaps between sends are gamma-distributed with shape = burstiness and
mean 1 / rate, so their variance is mean**2 / burstiness: burstiness 1 is a Poisson process,
below 1 burstier, above 1 more regular, infinite evenly spaced. The same seed gives the same
schedule. As `vllm bench serve` sends them: the first after one gap, and the whole schedule
scaled so that the last leaves at count / rate (the drawn gaps' sum misses that by a few
percent, which moved request throughput from one seed to the next by as much)."""

from __future__ import annotations

import math

import numpy as np

ARRIVAL_STREAM = 1  # keeps the arrival draws independent of the dataset draws for one seed


def arrival_gaps(count: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """`count` gaps in seconds; all zero at an infinite rate."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {request_rate}, {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(count)
    if math.isinf(burstiness):  # no variance at all: evenly spaced (gamma would give NaN)
        return np.full(count, 1.0 / request_rate)
    rng = np.random.default_rng((seed, ARRIVAL_STREAM))
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=count)


def send_offsets(count: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds after the start at which each of `count` requests is sent: the first after one
    gap, the last at count / rate (all at 0 at an infinite rate)."""
    offsets = np.cumsum(arrival_gaps(count, request_rate, burstiness, seed))
    if count and offsets[-1] > 0:
        offsets *= (count / request_rate) / offsets[-1]
    return offsets
