"""Reading a PNG's size from its header, to check plots without decoding them."""

from __future__ import annotations

import struct
from pathlib import Path

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height); AssertionError when the file is not a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == SIGNATURE and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])
