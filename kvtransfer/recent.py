"""RecentKeys: the keys seen most recently, as a set of bounded size."""

from __future__ import annotations

from collections import OrderedDict


class RecentKeys:
    """The last `size` keys added (the oldest forgotten first): for "has this failed or broken
    already?" on a long-running worker, whose full history would grow without end. Not
    thread-safe: its owner's lock guards it."""

    def __init__(self, size: int = 10_000) -> None:
        self.size = size
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> None:
        self._keys[key] = None
        if len(self._keys) > self.size:
            self._keys.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
