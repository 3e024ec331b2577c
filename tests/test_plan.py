"""The plan and the (N, cols) layout: single process, no communication."""

import mlx.core as mx
import pytest

from mlx_fsdp.plan import build_plan
from mlx_fsdp.step import local_piece, pack, unpack

SHAPES = [(7, 15), (), (15, 3), (16, 17), (1,), (3, 3, 3), (5,)]


def _sig(shapes, dtypes=None):
    dtypes = dtypes or ["float32"] * len(shapes)
    return tuple((f"p{i}", s, d, d, 0) for i, (s, d) in enumerate(zip(shapes, dtypes)))


def _arrays(shapes, dtypes=None):
    dtypes = dtypes or ["float32"] * len(shapes)
    return [mx.random.normal(s).astype(getattr(mx, d)) for s, d in zip(shapes, dtypes)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("budget", [0, 64, 10_000, 32 * 1024**2])
def test_pack_rows_are_the_pieces_and_unpack_restores(n, budget):
    arrays = _arrays(SHAPES)
    plan = build_plan(_sig(SHAPES), n, budget)
    assert sorted(s.index for b in plan.buckets for s in b.slots) == list(range(len(SHAPES)))
    for bucket in plan.buckets:
        packed = pack(bucket, arrays, n)
        assert packed.shape == (n, bucket.cols)
        for r in range(n):
            row = mx.concatenate([local_piece(s, arrays[s.index], r) for s in bucket.slots])
            assert mx.array_equal(packed[r], row)
        for slot, back in zip(bucket.slots, unpack(bucket, packed)):
            assert back.shape == slot.shape
            assert mx.array_equal(back, arrays[slot.index])


def test_sharded_matrices_are_enumerated_column_by_column():
    plan = build_plan(_sig([(7, 15), (15,), (3, 3, 3), ()]), 2, 0)
    assert {s.path: s.order for b in plan.buckets for s in b.slots} == {
        "p0": "F", "p1": "C", "p2": "C", "p3": "C"}
    assert [s.order for b in build_plan(_sig([(7, 15)]), 1, 0).buckets for s in b.slots] == ["C"]
    slot = plan.buckets[0].slots[0]
    a = mx.random.normal((7, 15))
    assert slot.cols == 53
    assert mx.array_equal(local_piece(slot, a, 0), a.T.reshape(-1)[:53])
    assert mx.array_equal(local_piece(slot, a, 1), mx.concatenate([a.T.reshape(-1)[53:], mx.zeros(1)]))
    # The order is the plan's, not the memory layout's: a transposed view gives the same pieces.
    stored_by_columns = mx.contiguous(a.T).T
    for r in (0, 1):
        assert mx.array_equal(local_piece(slot, stored_by_columns, r), local_piece(slot, a, r))
    (back,) = unpack(plan.buckets[0], pack(plan.buckets[0], [stored_by_columns], 2))
    assert mx.array_equal(back, a)


def test_padding_is_zero_and_counted():
    plan = build_plan(_sig([(7, 15), ()]), 4, 0)
    a = _arrays([(7, 15), ()])
    # 105 elements over 4 ranks: 27 columns, 3 zeros of padding; a scalar: 1 + 3.
    assert [s.cols for b in plan.buckets for s in b.slots] == [27, 1]
    assert plan.num_padding == 3 + 3
    assert mx.array_equal(pack(plan.buckets[0], a, 4)[3, -3:], mx.zeros(3))
    assert local_piece(plan.buckets[1].slots[0], a[1], 2).tolist() == [0.0]


def test_buckets_split_by_dtype_and_respect_the_budget():
    shapes = [(10, 10)] * 6
    dtypes = ["float32", "bfloat16", "float32", "bfloat16", "float32", "float16"]
    plan = build_plan(_sig(shapes, dtypes), 2, 900)
    for b in plan.buckets:
        assert {dtypes[s.index] for s in b.slots} == {b.dtype}
        assert b.nbytes(2) <= 900 or len(b.slots) == 1
    # 400 B per float32 array: two fit under 900; bf16 arrays (200 B) all fit.
    assert [len(b.slots) for b in plan.buckets] == [2, 1, 2, 1]
    assert [len(b.slots) for b in build_plan(_sig(shapes, dtypes), 2, 0).buckets] == [1] * 6


def test_array_larger_than_the_budget_gets_its_own_bucket():
    plan = build_plan(_sig([(4,), (1000,), (4,)]), 2, 64)
    assert [[s.path for s in b.slots] for b in plan.buckets] == [["p0"], ["p1"], ["p2"]]


def test_megabyte_arrays_travel_alone_and_need_no_packing_copy():
    # (512, 512) float32 is exactly 1 MiB; the small arrays around it still share.
    plan = build_plan(_sig([(4,), (512, 512), (4,), (511, 512)]), 2, 32 * 1024**2)
    assert [[s.path for s in b.slots] for b in plan.buckets] == [["p1"], ["p0", "p2", "p3"]]
    big = mx.random.normal((512, 512))
    packed = pack(plan.buckets[0], [None, big], 2)
    assert packed.shape == (2, 512 * 256)
    (back,) = unpack(plan.buckets[0], packed)
    assert mx.array_equal(back, big)


def test_plan_is_deterministic_and_fingerprint_sees_every_field():
    sig = _sig(SHAPES)
    assert build_plan(sig, 3, 1000) is build_plan(sig, 3, 1000)  # cached
    fp = build_plan(sig, 3, 1000).fingerprint()
    assert build_plan.__wrapped__(sig, 3, 1000).fingerprint() == fp
    other = list(sig)
    other[2] = ("p2", (15, 4), "float32", "float32", 0)
    for changed in (build_plan(tuple(other), 3, 1000), build_plan(sig, 4, 1000), build_plan(sig, 3, 999)):
        assert changed.fingerprint() != fp


def test_plan_prints_readably():
    text = str(build_plan(_sig([(7, 15), ()]), 4, 0))
    assert "2 arrays" in text and "p0 (7, 15): cols [0, 27), padding 3" in text


def test_unpack_casts_to_parameter_dtype():
    sig = (("w", (3, 5), "float32", "bfloat16", 0),)
    plan = build_plan(sig, 2, 0)
    (out,) = unpack(plan.buckets[0], mx.ones((2, 8)))
    assert out.dtype == mx.bfloat16 and out.shape == (3, 5)


def test_empty_tree_is_refused():
    with pytest.raises(ValueError, match="gradient tree is empty"):
        build_plan((), 2, 0)


def test_integer_arrays_are_refused_with_their_path():
    with pytest.raises(ValueError, match="'step_count' has dtype int32"):
        build_plan((("step_count", (3,), "int32", "int32", 0),), 2, 0)
