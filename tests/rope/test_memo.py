"""One registry holds every memo of the library, and `rope.clear_caches()` empties them all."""
from __future__ import annotations

import torch

import rope
from rope import _memo


def test_every_memo_registered_and_cleared():
    """A call fills the memos of its path (checked signature, values that passed, tables where they are on);
    clear_caches empties each, and the next call gives the same result."""
    t = torch.randn(6, 2, 3, 8)
    freqs = rope.RotaryPositionEmbedding(8)(8)
    start = torch.tensor([1, 2])
    q, k = torch.randn(6, 2, 3, 8), torch.randn(6, 2, 3, 8)
    want = rope.apply_rotary_pos_emb(t, freqs, start_positions=start)
    qkv = torch.randn(6, 2, 9, 8)
    rope.apply_rotary_pos_emb_qk(qkv[:, :, :3], qkv[:, :, 3:6], freqs, inplace=True)
    rope.apply_rotary_pos_emb_qk(q, k, freqs)
    names = {m.name for m in _memo.MEMOS}
    assert {"checked signatures and their launch plans", "index tensors whose values passed",
            "cos/sin and position tables", "disjointness of q and k views"} <= names, names
    assert any(len(m) for m in _memo.MEMOS)
    rope.clear_caches()
    assert all(len(m) == 0 for m in _memo.MEMOS), {m.name: len(m) for m in _memo.MEMOS}
    assert torch.equal(rope.apply_rotary_pos_emb(t, freqs, start_positions=start), want)


def test_memo_bound():
    """A full memo is emptied whole before the next entry (every entry is cheap to rebuild)."""
    m = _memo.Memo("test", 2)
    m.put(1, "a")
    m.put(2, "b")
    m.put(3, "c")
    assert dict(m) == {3: "c"}
