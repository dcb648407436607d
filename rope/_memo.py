"""Every memo of the library in one registry: what a call derives once and finds again by key (checked
signatures, values that passed, disjointness of views, cos/sin and position tables, device properties).

A memo is a dict (lookups at C speed on the hot path) with a bound: when full it is emptied whole, since every
entry is cheap to rebuild and per-entry eviction would cost bookkeeping on every call. `clear()` empties
them all (rope.clear_caches).
"""
from __future__ import annotations


class Memo(dict):
    __slots__ = ("name", "limit")

    def __init__(self, name: str, limit: int):
        super().__init__()
        self.name, self.limit = name, limit

    def put(self, key, value):
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


MEMOS: list = []


def memo(name: str, limit: int) -> Memo:
    m = Memo(name, limit)
    MEMOS.append(m)
    return m


def clear() -> None:
    """Empty every memo: checked signatures, launch plans, values that passed, tables. The next call of each
    signature checks and builds again."""
    for m in MEMOS:
        m.clear()
