"""The plan and the bucket layout: single process, no communication."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_fsdp import layout
from mlx_fsdp.plan import build_plan

SHAPES = [(7, 15), (), (15, 3), (16, 17), (1,), (3, 3, 3), (5,)]


def _sig(shapes, dtypes=None):
    dtypes = dtypes or ["float32"] * len(shapes)
    return tuple((f"p{i}", s, d, d, 0, "flat") for i, (s, d) in enumerate(zip(shapes, dtypes)))


def _arrays(shapes, dtypes=None):
    dtypes = dtypes or ["float32"] * len(shapes)
    return [mx.random.normal(s).astype(getattr(mx, d)) for s, d in zip(shapes, dtypes)]


def _reference_vector(bucket, arrays, n):
    """The documented layout, with numpy: the bucket's arrays flattened back to
    back (a matrix column by column when N > 1), then zeros up to N * cols."""
    parts = []
    for s in bucket.slots:
        a = np.array(arrays[s.index].astype(mx.float32))
        parts.append((a.T if a.ndim == 2 and n > 1 else a).reshape(-1))
    flat = np.concatenate(parts)
    return np.concatenate([flat, np.zeros(n * bucket.cols - flat.size, np.float32)])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("budget", [0, 64, 10_000, 32 * 1024**2])
def test_pack_shard_and_unpack_follow_the_documented_layout(n, budget):
    arrays = _arrays(SHAPES)
    plan = build_plan(_sig(SHAPES), n, budget)
    assert sorted(s.index for b in plan.buckets for s in b.slots) == list(range(len(SHAPES)))
    for bucket in plan.buckets:
        vector = layout.pack(bucket, arrays, n)
        expected = _reference_vector(bucket, arrays, n)
        assert vector.shape == (n * bucket.cols,)
        assert np.array_equal(np.array(vector), expected)
        for r in range(n):
            assert np.array_equal(np.array(layout.join(layout.range_parts(bucket, arrays, r, mx.float32), mx.float32)),
                                  expected[r * bucket.cols:(r + 1) * bucket.cols])
        for slot, back in zip(bucket.slots, layout.unpack(bucket, vector)):
            assert back.shape == slot.shape
            assert mx.array_equal(back, arrays[slot.index])


def test_every_rank_holds_about_one_nth_of_a_bucket():
    plan = build_plan(_sig(SHAPES), 3, 32 * 1024**2)
    (bucket,) = plan.buckets
    total = sum(s.size for s in bucket.slots)
    assert bucket.cols == -(-total // 3) and bucket.padding(3) == 3 * bucket.cols - total < 3
    # Slots lie back to back; an array may straddle two ranks' shards.
    assert [s.start for s in bucket.slots] == list(np.cumsum([0] + [s.size for s in bucket.slots])[:-1])
    assert {s.path for r in range(3) for s in bucket.held(r)} == {s.path for s in bucket.slots}


def test_sharded_matrices_are_enumerated_column_by_column():
    plan = build_plan(_sig([(7, 15), (15,), (3, 3, 3), ()]), 2, 0)
    assert {s.path: s.order for b in plan.buckets for s in b.slots} == {
        "p0": "F", "p1": "C", "p2": "C", "p3": "C"}
    assert [s.order for b in build_plan(_sig([(7, 15)]), 1, 0).buckets for s in b.slots] == ["C"]
    bucket = plan.buckets[0]
    a = mx.random.normal((7, 15))
    assert bucket.cols == 53
    def shard(arrays, r):
        return layout.join(layout.range_parts(bucket, arrays, r, mx.float32), mx.float32)

    assert mx.array_equal(shard([a], 0), a.T.reshape(-1)[:53])
    assert mx.array_equal(shard([a], 1), mx.concatenate([a.T.reshape(-1)[53:], mx.zeros(1)]))
    # What each rank holds: its piece of the array (rank 1's piece is 52 long, no padding).
    assert [p.shape for r in (0, 1) for _, p in layout.held_of(bucket, [a], r)] == [(53,), (52,)]
    # The order is the plan's, not the memory layout's: a transposed view gives the same shards.
    stored_by_columns = mx.contiguous(a.T).T
    for r in (0, 1):
        assert mx.array_equal(shard([stored_by_columns], r), shard([a], r))
    (back,) = layout.unpack(bucket, layout.pack(bucket, [stored_by_columns], 2))
    assert mx.array_equal(back, a)


def test_padding_is_zero_at_the_end_and_counted():
    plan = build_plan(_sig([(7, 15), ()]), 4, 10_000)
    (bucket,) = plan.buckets
    # 106 elements over 4 ranks: 27 each, 2 zeros of padding at the end.
    assert bucket.cols == 27 and plan.num_padding == 2
    vector = layout.pack(bucket, _arrays([(7, 15), ()]), 4)
    assert mx.array_equal(vector[-2:], mx.zeros(2))


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


def test_large_arrays_share_buckets_up_to_the_budget():
    # The grouped-gradient design: buckets of up to communication_size, large
    # arrays included (one collective per bucket, not per array).
    plan = build_plan(_sig([(4,), (512, 512), (4,), (511, 512)]), 2, 32 * 1024**2)
    assert [[s.path for s in b.slots] for b in plan.buckets] == [["p0", "p1", "p2", "p3"]]
    plan = build_plan(_sig([(512, 512)] * 5), 2, 3 * 1024**2)  # 1 MiB each, 3 per bucket
    assert [len(b.slots) for b in plan.buckets] == [3, 2]


def test_lone_array_round_trips_without_padding():
    plan = build_plan(_sig([(512, 256)]), 2, 0)
    big = mx.random.normal((512, 256))
    vector = layout.pack(plan.buckets[0], [big], 2)
    assert vector.shape == (512 * 256,) and plan.num_padding == 0
    (back,) = layout.unpack(plan.buckets[0], vector)
    assert mx.array_equal(back, big)


def test_plan_is_deterministic_and_fingerprint_sees_every_field():
    sig = _sig(SHAPES)
    assert build_plan(sig, 3, 1000) is build_plan(sig, 3, 1000)  # cached
    fp = build_plan(sig, 3, 1000).fingerprint
    assert build_plan.__wrapped__(sig, 3, 1000).fingerprint == fp
    other = list(sig)
    other[2] = ("p2", (15, 4), "float32", "float32", 0, "flat")
    for changed in (build_plan(tuple(other), 3, 1000), build_plan(sig, 4, 1000), build_plan(sig, 3, 999)):
        assert changed.fingerprint != fp


def test_plan_prints_readably():
    text = str(build_plan(_sig([(7, 15), ()]), 4, 10_000))
    assert "2 arrays" in text and "p0 (7, 15): [0, 105) on ranks 0-3, column by column" in text
    assert "p1 (): [105, 106) on ranks 3-3" in text


def test_unpack_casts_to_parameter_dtype():
    sig = (("w", (3, 5), "float32", "bfloat16", 0, "flat"),)
    plan = build_plan(sig, 2, 0)
    (out,) = layout.unpack(plan.buckets[0], mx.ones((16,)))
    assert out.dtype == mx.bfloat16 and out.shape == (3, 5)


def test_empty_tree_is_refused():
    with pytest.raises(ValueError, match="gradient tree is empty"):
        build_plan((), 2, 0)


def test_integer_arrays_are_refused_with_their_path():
    with pytest.raises(ValueError, match="'step_count' has dtype int32"):
        build_plan((("step_count", (3,), "int32", "int32", 0, "flat"),), 2, 0)
