"""The JSON files cost models are saved in: a kind and a version first, then the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
PROFILE_FILE = "tandem-profile.json"  # a step cost model saved next to the model's weights
TRANSFER_PROFILE_FILE = "tandem-transfer-profile.json"  # a KV transfer cost model, likewise


class CostModelError(ValueError):
    """A cost model file or a set of measurements that cannot be used; the message says why."""


def check_kind(data: Any, kind: str) -> None:
    if not isinstance(data, dict) or data.get("kind") != kind:
        raise CostModelError(f"not a {kind} file")
    if data.get("version") != FORMAT_VERSION:
        raise CostModelError(
            f"{kind} version {data.get('version')} (this tandem reads {FORMAT_VERSION})"
        )


def save_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as err:
        raise CostModelError(f"cannot read {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise CostModelError(f"{path} is not JSON: {err}") from None
    except UnicodeDecodeError:
        raise CostModelError(f"{path} is not JSON: not UTF-8 text") from None
