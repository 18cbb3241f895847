"""The control plane and its HTTP front end load no torch when imported: the coordinator
process stays light, and only worker processes pay for the model stack."""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "coordinator.coordinator",
    "coordinator.router",
    "coordinator.request_state",
    "coordinator.builder",
    "coordinator.api.app",
    "protocol.messages",
    "protocol.stats",
]


def test_importing_the_coordinator_loads_no_torch() -> None:
    code = f"import sys\nfor m in {MODULES!r}: __import__(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
