"""How much longer a decode step takes beside a prefill step on a shared CPU host.

A decode step that starts while a prefill worker is in a step runs `factor` times slower for as
long as that prefill step lasts (their threads preempt each other), then at its own pace:

    prefill step   ├──────────────┤
    decode step          ├╌╌╌╌╌╌╌╌┼────┤     slowed for `overlap`, its own pace after
                         start    prefill ends

Freezing the factor for the whole step, as a first version did, stretched a decode step that
started near the end of a prefill step, or that drew a large measured factor, far past the
prefill step that slowed it. `benchmarks/simulator_fidelity.py` measures the factors on the
real decode steps that ended inside the prefill step they started in (took / modelled); one
that outlasted it says little: with a 2 ms overlap, 1 ms more or less of a 20 ms step moves
the factor that explains it from 10 to 20.
"""

from __future__ import annotations


def slowed(seconds: float, factor: float, overlap: float) -> float:
    """How long a step of `seconds` (alone) lasts when it runs `factor` times slower for its
    first `overlap` seconds of wall time, then at its own pace."""
    if seconds * factor <= overlap:
        return seconds * factor
    return overlap + seconds - overlap / factor
