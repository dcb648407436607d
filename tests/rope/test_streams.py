"""Concurrency on a GPU: several streams, threads, and CUDA-graph replay (docs/design.md, "The tables").

The cos/sin table of a `freqs` tensor and the position table of a `cu_seqlens` tensor are built on
the stream of the first call that needs them and cached. Every test here makes another stream read
such a table while the builder's stream is still busy, or after the table's source was freed, and
checks each result against the float64 reference.

Each test warms up first (same shapes, other tensors): the first launch of a kernel loads its
module, and that synchronizes the device, which would hide every race below. Where a hazard would
read memory that nothing wrote yet, that memory is first filled with values that cannot pass
(NaN angles, positions far past `freqs`), so a missing wait shows on every run.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch

import rope
import rope._table as table_mod
from rope import reference

from .cases import DEVICE, gpu_only, make_freqs, make_t
from .numerics import assert_within_rounding

pytestmark = gpu_only

SLEEP_CYCLES = 200_000_000  # about 0.1 s at the clocks of current GPUs: far longer than any call here


def _reference(t, freqs, **kw):
    return reference.apply_rotary_pos_emb(t.double(), freqs, **kw)


def _poison_free_blocks(shape, dtype, value, count=8):
    """Leave `count` freed blocks of this size in the current stream's pool, filled with `value`:
    the next allocations of that size take them, so a table read before it is written reads them."""
    junk = [torch.full(shape, value, dtype=dtype, device=DEVICE) for _ in range(count)]
    del junk


def _many_seqs(gen, n_seqs=48, h=2, d=16, max_len=6):
    """A packed thd batch with enough sequences that its positions come from a table."""
    lengths = torch.randint(1, max_len + 1, (n_seqs,), generator=gen)
    cu = torch.zeros(n_seqs + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    t = make_t("thd", int(cu[-1]), 1, h, d, torch.float32, gen)
    return t, cu.to(DEVICE), make_freqs(max_len + 2, d, gen)


@pytest.fixture
def streams():
    table_mod._TABLES.clear()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda._sleep(1000)  # the sleep kernel's module is loaded now, not inside a test's window
    torch.cuda.synchronize()
    yield s1, s2
    torch.cuda.synchronize()
    table_mod._TABLES.clear()


def test_freqs_table_built_on_a_busy_stream(streams):
    """s1 builds the table behind a long kernel; s2 reads it at once. s2 must wait for the build."""
    s1, s2 = streams
    gen = torch.Generator().manual_seed(1)
    t = make_t("sbhd", 64, 2, 4, 64, torch.float32, gen)
    rope.apply_rotary_pos_emb(t, make_freqs(64, 64, gen))  # warm-up: compiles, loads, plans
    freqs = make_freqs(64, 64, gen)
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        _poison_free_blocks((64, 2, 64), torch.float32, float("nan"))
        torch.cuda._sleep(SLEEP_CYCLES)
        out1 = rope.apply_rotary_pos_emb(t, freqs)  # builds the table, behind the sleep
    with torch.cuda.stream(s2):
        out2 = rope.apply_rotary_pos_emb(t, freqs)  # finds it cached
    torch.cuda.synchronize()
    ref = _reference(t, freqs)
    assert_within_rounding(out1, ref, t, 64, False, "builder stream")
    assert_within_rounding(out2, ref, t, 64, False, "other stream")


def test_position_table_built_on_a_busy_stream(streams):
    """The same for the thd position table of a new `cu_seqlens` tensor."""
    s1, s2 = streams
    gen = torch.Generator().manual_seed(2)
    t, cu, freqs = _many_seqs(gen)
    rope.apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu.clone())  # warm-up
    cu = cu.clone()
    with table_mod.evaluated():  # the values of `cu` pass their check now: a check inside the
        rope.apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu)  # window would wait for s1
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        _poison_free_blocks((t.shape[0],), torch.int64, 1 << 40)
        torch.cuda._sleep(SLEEP_CYCLES)
        out1 = rope.apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu)
    with torch.cuda.stream(s2):
        out2 = rope.apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu)
    torch.cuda.synchronize()
    ref = _reference(t, freqs, tensor_format="thd", cu_seqlens=cu)
    assert_within_rounding(out1, ref, t, 16, False, "builder stream")
    assert_within_rounding(out2, ref, t, 16, False, "other stream")


@pytest.mark.parametrize("source", ["freqs", "cu_seqlens"])
def test_source_freed_while_another_stream_reads(streams, source):
    """A reader on s2 is queued behind a long kernel; meanwhile the table's source dies (so the
    table is freed) and the builder's stream allocates and fills memory of the same size. The
    table's memory must not be handed out before s2 has read it."""
    s1, s2 = streams
    gen = torch.Generator().manual_seed(3)
    t, cu, freqs = _many_seqs(gen)
    kw = dict(tensor_format="thd", cu_seqlens=cu.clone())
    rope.apply_rotary_pos_emb(t, freqs.clone(), **kw)  # warm-up
    src = (freqs if source == "freqs" else cu).clone()
    kw_src = dict(kw, cu_seqlens=src) if source == "cu_seqlens" else kw
    f_src = src if source == "freqs" else freqs
    s1.wait_stream(torch.cuda.current_stream())  # src is written on this stream
    with torch.cuda.stream(s1):
        rope.apply_rotary_pos_emb(t, f_src, **kw_src)  # builds the table on s1
    ref = _reference(t, f_src, **kw_src)
    torch.cuda.synchronize()
    with torch.cuda.stream(s2):
        torch.cuda._sleep(SLEEP_CYCLES)
        out = rope.apply_rotary_pos_emb(t, f_src, **kw_src)  # reads it, behind the sleep
    shape, dtype, value = (((freqs.shape[0], 2, 16), torch.float32, float("nan")) if source == "freqs"
                           else ((t.shape[0],), torch.int64, 1 << 40))
    del kw_src, f_src, src  # the source dies: its table is freed while s2 still has to read it
    with torch.cuda.stream(s1):
        junk = [torch.full(shape, value, dtype=dtype, device=DEVICE) for _ in range(8)]
    torch.cuda.synchronize()
    del junk
    assert_within_rounding(out, ref, t, 16, False, f"reader of a freed {source} table")


def test_threads_share_a_table_built_on_a_busy_stream(streams):
    """Threads with their own streams and one shared `freqs`: the first builds its table behind a
    long kernel, the others read it at once; then each goes on with shapes of its own."""
    gen = torch.Generator().manual_seed(4)
    t = make_t("bshd", 48, 2, 4, 32, torch.bfloat16, gen)
    rope.apply_rotary_pos_emb(t, make_freqs(48, 32, gen), "bshd")  # warm-up
    freqs = make_freqs(48, 32, gen)
    torch.cuda.synchronize()
    built = threading.Event()
    results, errors = {}, []

    def work(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                if i == 0:
                    _poison_free_blocks((48, 2, 32), torch.float32, float("nan"))
                    torch.cuda._sleep(SLEEP_CYCLES)
                    results[i] = [rope.apply_rotary_pos_emb(t, freqs, "bshd")]
                    built.set()
                else:
                    built.wait(10)
                    results[i] = [rope.apply_rotary_pos_emb(t, freqs, "bshd")]
                own = make_freqs(48, 32, torch.Generator().manual_seed(100 + i))
                for _ in range(20):
                    results[i].append((own, rope.apply_rotary_pos_emb(t, own, "bshd")))
            stream.synchronize()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    torch.cuda.synchronize()
    assert not errors, errors
    ref = _reference(t, freqs, tensor_format="bshd")
    for i, (shared, *own) in sorted(results.items()):
        assert_within_rounding(shared, ref, t, 32, False, f"thread {i}, shared freqs")
        for f, out in own:
            assert_within_rounding(out, _reference(t, f, tensor_format="bshd"), t, 32, False, f"thread {i}")
    assert len(results) == len(threads)


def test_graph_replay_follows_inputs_changed_in_place():
    """Captured once, replayed after freqs, start_positions and cu_seqlens change in place: every
    replay reads the values the tensors hold then (no table built before the capture is used)."""
    gen = torch.Generator().manual_seed(5)
    t_sb = make_t("sbhd", 16, 3, 2, 32, torch.float32, gen)
    t_thd, cu, _ = _many_seqs(gen, d=32)
    n_tokens, n_seqs = t_thd.shape[0], cu.shape[0] - 1
    freqs = make_freqs(n_tokens, 32, gen)  # long enough for one sequence of every token
    start = torch.randint(0, 32, (3,), generator=gen).to(DEVICE)
    kw_sb = dict(start_positions=start, cp_size=2, cp_rank=1)
    kw_thd = dict(tensor_format="thd", cu_seqlens=cu)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager calls first: they build tables, which a capture must ignore
        rope.apply_rotary_pos_emb(t_sb, freqs, **kw_sb)
        rope.apply_rotary_pos_emb(t_thd, freqs, **kw_thd)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_sb = rope.apply_rotary_pos_emb(t_sb, freqs, **kw_sb)
        out_thd = rope.apply_rotary_pos_emb(t_thd, freqs, **kw_thd)
    for replay in range(3):
        freqs.copy_(make_freqs(n_tokens, 32, gen))
        start.copy_(torch.randint(0, 32, (3,), generator=gen))
        cuts = torch.randint(0, n_tokens + 1, (n_seqs - 1,), generator=gen).sort().values
        cu[1:-1].copy_(cuts)  # the same token count, other boundaries
        graph.replay()
        torch.cuda.synchronize()
        assert_within_rounding(out_sb, _reference(t_sb, freqs, **kw_sb), t_sb, 32, False, f"sbhd, replay {replay}")
        assert_within_rounding(out_thd, _reference(t_thd, freqs, **kw_thd), t_thd, 32, False, f"thd, replay {replay}")


FORMATS = ("sbhd", "bshd", "thd")
# The kinds of call the threads draw from: each kind is one kernel specialization, compiled by whichever thread
# meets it first (the threads also compile concurrently), so the test's time is its calls, not about one compile
# per call as with every call's structure drawn afresh.
KINDS = 32


def _random_kind(rnd: random.Random) -> dict:
    """A call's structure: format, shape, dtype, partial rotary, interleaved, start_positions, cp."""
    fmt = rnd.choice(FORMATS)
    d = rnd.choice([16, 32, 64, 80, 128])
    cp = rnd.choice([1, 1, 2])
    kind = dict(fmt=fmt, dtype=rnd.choice([torch.float32, torch.bfloat16, torch.float16]), h=rnd.randint(1, 8), d=d,
                d2=rnd.choice([d, d // 2 - d // 2 % 2]), cp=cp, rank=rnd.randrange(cp),
                interleaved=rnd.random() < 0.3, start=rnd.random() < 0.4)
    if fmt == "thd":
        kind.update(n=rnd.choice([3, 40]))
    else:
        kind.update(s=2 * rnd.randint(1, 32), b=rnd.randint(1, 4))
    return kind


def _random_call(rnd: random.Random, gen, shared_freqs, kinds):
    """A random call of one of `kinds`: its tensors' values, thd's sequence lengths and the choice of a shared or a
    fresh `freqs` drawn anew."""
    kind = rnd.choice(kinds)
    fmt, dtype, h, d, d2, cp = (kind[k] for k in ("fmt", "dtype", "h", "d", "d2", "cp"))
    kw = dict(tensor_format=fmt, interleaved=kind["interleaved"])
    if cp > 1:
        kw.update(cp_size=cp, cp_rank=kind["rank"])
    if fmt == "thd":
        n = kind["n"]
        lengths = torch.randint(0, 9, (n,), generator=gen) * 2 * cp
        cu = torch.zeros(n + 1, dtype=torch.int64)
        cu[1:] = lengths.cumsum(0)
        kw["cu_seqlens"] = cu.to(DEVICE)
        t = make_t("thd", int(cu[-1]) // cp, 1, h, d, dtype, gen)
        n_seqs = n
    else:
        t = make_t(fmt, kind["s"], kind["b"], h, d, dtype, gen)
        n_seqs = kind["b"]
    if kind["start"]:
        kw["start_positions"] = torch.randint(0, 16, (n_seqs,), generator=gen).to(DEVICE)
    freqs = shared_freqs[d2] if rnd.random() < 0.5 else make_freqs(16 + 2 * 64 * 2 + 1, d2, gen)
    return t, freqs, kw


@pytest.mark.slow
def test_stress_threads_and_streams(record_property):
    """Threads x streams x random calls of KINDS kinds, each checked against the float64 reference; shared freqs
    tensors (tables read across streams) and fresh ones (tables built and freed all the time)."""
    threads_n, streams_n, calls = 4, 2, 250
    kinds = [_random_kind(random.Random(10_000 + i)) for i in range(KINDS)]
    shared = {d2: make_freqs(16 + 2 * 64 * 2 + 1, d2, torch.Generator().manual_seed(d2))
              for d2 in (6, 8, 14, 16, 30, 32, 38, 40, 62, 64, 80, 128)}
    torch.cuda.synchronize()
    table_mod._TABLES.clear()
    before = torch.cuda.memory_allocated()
    wrong, done, errors = [], [0], []
    lock = threading.Lock()

    def work(i):
        try:
            rnd, gen = random.Random(i), torch.Generator().manual_seed(1000 + i)
            streams = [torch.cuda.Stream() for _ in range(streams_n)]
            pending = []
            for c in range(calls):
                t, freqs, kw = _random_call(rnd, gen, shared, kinds)
                stream = streams[c % streams_n]
                with torch.cuda.stream(stream):
                    if rnd.random() < 0.1:
                        torch.cuda._sleep(rnd.randint(1, 200_000))
                    pending.append((t, freqs, kw, rope.apply_rotary_pos_emb(t, freqs, **kw)))
                if len(pending) >= 16:
                    _check_pending(pending, streams, wrong, lock)
                    with lock:
                        done[0] += len(pending)
                    pending.clear()
            _check_pending(pending, streams, wrong, lock)
            with lock:
                done[0] += len(pending)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    torch.cuda.synchronize()
    table_mod._TABLES.clear()
    growth = torch.cuda.memory_allocated() - before
    record_property("stress", dict(calls=done[0], wrong=len(wrong), memory_growth_bytes=growth))
    print(f"\nstress: {threads_n} threads x {streams_n} streams, {done[0]} calls checked, {len(wrong)} wrong, "
          f"memory growth {growth} bytes")
    assert not errors, errors
    assert done[0] == threads_n * calls
    assert not wrong, wrong[:5]
    assert growth <= 0, f"{growth} bytes still allocated after every call's tensors and tables were freed"


def _check_pending(pending, streams, wrong, lock):
    for stream in streams:
        stream.synchronize()
    for t, freqs, kw, out in pending:
        try:
            assert_within_rounding(out, _reference(t, freqs, **kw), t, freqs.shape[-1], kw["interleaved"], "stress")
        except AssertionError as e:
            with lock:
                wrong.append(f"{tuple(t.shape)} {t.dtype} {kw.get('tensor_format')}: {str(e)[:200]}")
