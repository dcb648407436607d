"""The position table cached per `cu_seqlens` tensor (rope._table.token_positions): each packed
token's position as docs/contract.md section 3 defines it, reused exactly while it describes `cu_seqlens`,
never stale, never used where it could not follow `cu_seqlens`, and read by the kernel where it
replaces the search of `cu_seqlens` (thd without start_positions, many sequences)."""
from __future__ import annotations

import pytest
import torch

import rope
import rope._table as table_mod
from rope import _backend, _launch, _memo, reference

from .cases import (  # noqa: F401
    angle_source,
    cu_seqlens_of,
    many_sequence_lengths,
    many_sequences_case,
    poison_outputs,
)
from .numerics import assert_within_rounding


def _spec_positions(lengths, cp_size, cp_rank):
    """docs/contract.md section 3, token by token: offset j in the local part of its sequence, and under
    context parallelism the two chunks cp_rank and 2 * cp_size - 1 - cp_rank of c = L / 2 each."""
    out = []
    for length in lengths:
        local = length // cp_size
        c = local // 2
        for j in range(local):
            if cp_size == 1:
                out.append(j)
            else:
                out.append(j + cp_rank * c if j < c else j - c + (2 * cp_size - 1 - cp_rank) * c)
    return out


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_positions_follow_the_spec(cp_size):
    gen = torch.Generator().manual_seed(cp_size)
    lengths = many_sequence_lengths(50, cp_size, gen)
    cu = cu_seqlens_of(lengths)
    n_tokens = sum(lengths) // cp_size
    for cp_rank in range(cp_size):
        got = table_mod._build_positions(cu, n_tokens, cp_size, cp_rank)
        assert got.dtype == torch.int64 and got.device == cu.device
        assert got.tolist() == _spec_positions(lengths, cp_size, cp_rank)


@pytest.fixture
def position_builds(monkeypatch):
    """Count the position tables built."""
    made = []
    real = table_mod._build_positions
    monkeypatch.setattr(table_mod, "_build_positions", lambda *a: (made.append(a[1:]), real(*a))[1])
    table_mod._TABLES.clear()
    yield made
    table_mod._TABLES.clear()


def test_position_table_is_reused_and_never_stale(position_builds):
    gen = torch.Generator().manual_seed(7)
    lengths = many_sequence_lengths(40, 1, gen)
    cu = cu_seqlens_of(lengths)
    n = sum(lengths)
    first = table_mod.token_positions(cu, n, 1, 0)
    assert table_mod.token_positions(cu, n, 1, 0) is first  # every layer, q and k, both directions
    assert len(position_builds) == 1
    cu.mul_(1)  # an in-place write PyTorch sees (the version counter moves), even with equal values
    assert table_mod.token_positions(cu, n, 1, 0) is not first
    assert len(position_builds) == 2
    twin = cu.detach()  # another tensor object at the same address and version
    table_mod._TABLES[(id(twin), n, 1, 0)] = table_mod._TABLES.pop((id(cu), n, 1, 0))
    table_mod.token_positions(twin, n, 1, 0)
    assert len(position_builds) == 3
    with torch.inference_mode():  # no version counter: a table could not notice writes
        assert table_mod.token_positions(cu.clone(), n, 1, 0) is None
    rope.set_angle_table(False)
    try:
        assert table_mod.token_positions(cu, n, 1, 0) is None
    finally:
        rope.set_angle_table(True)
    assert len(position_builds) == 3


def _plans_read_positions():
    return {bool(p.arg("POS_TABLE")) for call in _backend._CALLS.values() for p in call.plans.values()}


# The kernel's two ways of placing a packed token: the position table (table run, no
# start_positions) and the search of cu_seqlens (the evaluated run, or start_positions). Many
# sequences, most of them empty, under context parallelism too; after an in-place change of
# cu_seqlens the next call must see the new sequences.
@pytest.mark.parametrize("cp,start", [(None, False), ((2, 1), False), ((3, 0), False), (None, True)], ids=str)
def test_thd_positions_from_the_table(cp, start, angle_source, monkeypatch, poison_outputs):  # noqa: F811
    monkeypatch.setattr(_backend, "_CALLS", _memo.Memo("plans of this test", 4096))
    gen = torch.Generator().manual_seed(11 + (cp or (1, 0))[0] + start)
    n_seqs = _launch._SEARCH_FANOUT + 3
    t, freqs, g, kw = many_sequences_case(n_seqs, cp, start, torch.bfloat16, gen)
    d = t.shape[-1]
    for _ in range(2):
        x = t.detach().clone().requires_grad_()
        q, k = rope.apply_rotary_pos_emb_qk(x, x.detach().clone(), freqs, **kw)
        out = rope.apply_rotary_pos_emb(x, freqs, **kw)
        out.backward(g)
        x64 = t.detach().double().requires_grad_()
        ref = reference.apply_rotary_pos_emb(x64, freqs, **kw)
        ref.backward(g.double())
        assert_within_rounding(out, ref, t, d, False, "forward")
        assert_within_rounding(x.grad, x64.grad, g, d, False, "backward")
        assert_within_rounding(q, ref, t, d, False, "forward (q of q+k)")
        assert_within_rounding(k, ref, t, d, False, "forward (k of q+k)")
        assert _plans_read_positions() == {angle_source == "table" and not start}
        # Move every token to the next sequence's range: same tokens, other positions.
        cu = kw["cu_seqlens"]
        lengths = (cu[1:] - cu[:-1]).tolist()
        cu.copy_(cu_seqlens_of(lengths[1:] + lengths[:1]))


@pytest.mark.parametrize("cp_size", [2, 3])
def test_positions_follow_the_spec_for_every_chunk_length(cp_size):
    """Every local chunk length c from 1 to 16 (sequences of 2 * cp_size * c tokens): the second chunk's offset
    (2 cp_size - 1 - cp_rank) c is added to the position within it, whatever bits the two share."""
    lengths = [2 * cp_size * c for c in range(1, 17)]
    cu = cu_seqlens_of(lengths)
    for cp_rank in range(cp_size):
        got = table_mod._build_positions(cu, sum(lengths) // cp_size, cp_size, cp_rank)
        assert got.tolist() == _spec_positions(lengths, cp_size, cp_rank)
