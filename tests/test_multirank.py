"""Real ranks: ring at N=2, MPI at N=3 and N=4, each launch under a hard timeout.

Every comparison is against code that is not ours: plain ``mlx.optimizers`` on
gradients averaged in one process (the reference), and ``ddp_step``, which is
``mlx.nn.average_gradients`` plus the plain optimizer.
"""

import json

import pytest

from launch import run_ranks

F32_TOL = 1e-5
BF16_ULP_AT_ONE = 2.0**-7  # one bfloat16 ulp for values in [1, 2): a bound for |w| < 2

OPTIMIZERS = ["sgd", "adam", "adamw", "lion", "multi"]


def _configs(bf16):
    # Clipping with tiny buckets (many buckets, every array padded differently),
    # one array per bucket (the most collectives in one step: ranks must run
    # them in one order although only some ranks hold padding), and no
    # clipping with the default 32 MiB budget (one bucket per dtype).
    return ([f"{o}:0.5:300:{bf16}" for o in OPTIMIZERS]
            + [f"{o}:-1:0:{bf16}" for o in OPTIMIZERS]
            + [f"{o}:-1:33554432:{bf16}" for o in OPTIMIZERS])


def _check(results, vs_reference=True, compiled=None):
    assert len(results) == 3 * len(OPTIMIZERS)
    for r in results:
        cfg, whole = r["config"], json.dumps(r, default=str)  # a repr is cut short in reports
        # Both steps compile their update, or neither (a GPU rounds otherwise compiled).
        calls = r["compiled_updates"]
        assert (calls["fsdp"] > 0) == (calls["ddp"] > 0), whole
        assert compiled is None or (calls["fsdp"] > 0) == compiled, whole
        assert r["fsdp_ddp_f32"] <= F32_TOL, whole
        assert r["fsdp_ddp_bf16"] <= BF16_ULP_AT_ONE, whole
        if vs_reference:
            assert r["fsdp_ref_f32"] <= F32_TOL, whole
            assert r["fsdp_ref_bf16"] <= BF16_ULP_AT_ONE, whole
        if ":0.5:" in cfg:
            assert r["clipped"] >= 1, f"clipping never engaged in {cfg}: the test would not see it"
            assert r["norm_ddp"] <= 1e-5 and (not vs_reference or r["norm_ref"] <= 1e-5), r
            assert r["buckets"] > 3, r
        elif cfg.split(":")[2] == "0":
            assert r["buckets"] == 11, r
        else:
            groups = 2 if cfg.startswith("multi") else 1
            assert r["buckets"] == groups * (2 if "bfloat16" in r["dtypes"] else 1), r


def test_parity_ring_n2_with_bf16_part():
    results = run_ranks(2, "parity.py", [4, *_configs(1)])
    for r in results:
        assert r["dtypes"] == ["bfloat16", "float32"]
        assert r["param_dtypes"]["table.weight"] == "bfloat16", "a bf16 parameter must stay bf16"
    _check(results)


@pytest.mark.parametrize("n", [3, 4])
def test_parity_mpi_fp32_against_plain_mlx(n):
    _check(run_ranks(n, "parity.py", [4, *_configs(0)]))


@pytest.mark.parametrize("n", [2, 3])
def test_native_sum_scatter_path_through_an_emulated_sum_scatter(n):
    # NCCL and JACCL reduce-scatter the packed bucket vector with sum_scatter.
    # Ring and MPI lack it, so here it is emulated (all_sum, keep this rank's
    # part) and forced, and the whole step must still equal DDP and plain MLX.
    env = {"MLX_FSDP_TEST_EMULATE_SUM_SCATTER": "1", "MLX_FSDP_REDUCE_SCATTER": "native"}
    results = run_ranks(n, "parity.py", [3, *_configs(0)], env=env)
    assert all(r["method"] == "native" for r in results), results
    _check(results)


@pytest.mark.parametrize("n, bf16", [(2, 1), (3, 0)])
def test_parity_with_the_compiled_update(n, bf16):
    # Both steps' updates compiled, as on a GPU; on the CPU against the
    # eager plain-MLX reference (compiled on a GPU, which rounds otherwise
    # compiled); at N=2 with a bfloat16 part.
    _check(run_ranks(n, "parity.py", [3, *_configs(bf16)], env={"MLX_FSDP_FUSED_UPDATE": "1"}),
           compiled=True)


@pytest.mark.parametrize("n", [3, 4])
def test_parity_mpi_bf16_part_against_ddp(n):
    # The reference sums bfloat16 gradients in another order than MPI's
    # all-reduce, which rounds differently; DDP uses the same all-reduce.
    _check(run_ranks(n, "parity.py", [4, *_configs(1)]), vs_reference=False)


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_two_rank_exchange_equals_all_sum_bit_for_bit(backend):
    (r,) = run_ranks(2, "exchange.py", backend=backend)
    assert r["auto"] == "exchange", r
    assert r["rows_equal"] and r["pieces_equal"], r
    assert r["steps_equal"] and r["arrays"] == 11, r


@pytest.mark.parametrize("n,backend,method", [(2, "ring", "exchange"), (2, "ring", "all_sum"),
                                              (3, "mpi", None)])
def test_unpaced_updates_wait_only_for_the_reduce_scatters_before_theirs(n, backend, method):
    # On a GPU MLX is not paced: an update that depends on a later bucket's
    # collective runs after it, holding its own buffers meanwhile. When every
    # update waited for the last one, the MLP 4 x 2048 peaked 8 MiB higher on
    # an H100 (2026-11-27). Each layer's state must see only the collectives
    # up to its own bucket's, which the chain orders: 1, 2, 3, ...
    env = {} if method is None else {"MLX_FSDP_REDUCE_SCATTER": method}
    (r,) = run_ranks(n, "update_order.py", backend=backend, env=env)
    assert r["buckets"] == 3, r
    waits = r["waits"][::-1]  # in the order the buckets are reduced
    assert all(a < b for a, b in zip(waits, waits[1:])), r


@pytest.mark.parametrize("n", [2, 3, 4])
def test_owner_buckets_mostly_padding_are_summed_bit_for_bit(n):
    # A lone large array's owner bucket at N > 2 is all-summed without its
    # padding (mlx_fsdp.summed): the same arrays as the padded all-gather,
    # signed zeros included, and each owner the sum of the gradients.
    (r,) = run_ranks(n, "summed.py")
    assert r["exact"] and r["gathered_like_padded"] and r["reduced"], r
    assert any(r["applies"]) == (n > 2), r


def test_state_and_peak_memory_below_ddp_at_n2():
    (r,) = run_ranks(2, "memory.py", [512, 4])
    assert r["fsdp_state"] <= r["ddp_state"] * (1 / 2 + 0.02), r
    assert r["fsdp_peak"] < r["ddp_peak"], r


@pytest.mark.parametrize("n, hidden, layers, size", [(2, 512, 4, 2 * 2**20),
                                                      (3, 256, 16, 2**18)])
def test_fsdp_step_reduces_one_bucket_at_a_time_on_the_cpu(n, hidden, layers, size):
    # A layer per bucket, SGD, the gradients evaluated first. Each bucket's
    # reduce-scatter waits for the one before to finish (mlx_fsdp.pace); run
    # ahead, MLX packed and reduced every bucket at once: 8.0 layers above
    # the start at ring N=2 (4 x 512), 9.1-9.4 at MPI N=3 (16 x 256, biases
    # in buckets of their own). Paced, what every bucket keeps (1/N of the
    # gradients) and one bucket's buffers: 3.5 and 6.4 (mlx 0.32.4, 2026-11-28).
    (r,) = run_ranks(n, "reduce_ahead.py", [hidden, layers, size])
    assert r["buckets"] >= layers, r
    one_bucket = 1.5 if n == 2 else 1.0  # the exchange's sent half and vector; the all-sum's
    assert r["most"] <= (layers / n + one_bucket + 0.5) * r["layer"], r


@pytest.mark.parametrize("n", [2, 4])
def test_nothing_outlives_the_model_and_optimizer(n):
    # The step keeps a token of its last collective for the group's next
    # step; unevaluated, it held a whole bucket of parameters (1 MiB here).
    (r,) = run_ranks(n, "memory.py", [512, 2])
    assert r["ddp_left"] <= 1024 and r["fsdp_left"] <= 1024, r


def test_owner_buckets_of_large_matrices_hold_less_than_ddp_at_n3():
    # Adafactor keeps each 1024 x 1024 matrix whole on an owner; each is too
    # large to share a bucket, so N - 1 of its bucket's N shards are padding.
    # Reduce-scattered and all-gathered with it, the step's buffers were N
    # times every matrix, and FSDP peaked above DDP (MPI N=4, MLP 4 x 1024:
    # 164.1 against 96.2 MiB); they are all-summed without it now.
    (r,) = run_ranks(3, "memory.py", [1024, 4, "adafactor"])
    assert r["fsdp_peak"] < 0.8 * r["ddp_peak"], r


def test_owner_buckets_half_padding_free_it_at_n2():
    # At N=2 a matrix too large to share a bucket has an owner bucket half
    # padding, still all-gathered padded. The new parameters are copied out
    # of the gathered vector (views kept the padding: 4.0 MiB here), and
    # the next gather waits for the copies; MLX ran them at the step's end,
    # every vector alive: FSDP peaked above DDP (MLP 16 x 256, Adafactor in
    # 256 KiB buckets: 17.12 against 15.09 MiB, 11.36 so; 2026-11-30). On a
    # GPU, unpaced, the step runs further ahead: 0.937 of DDP's peak on an
    # H200 (2026-12-01, eight test files at once), still below DDP's.
    (r,) = run_ranks(2, "memory.py", [256, 16, "adafactor", 2**18])
    assert r["fsdp_kept"] <= 16 * 1024, r
    assert r["fsdp_peak"] < (0.85 if r["device"] == "cpu" else 1.0) * r["ddp_peak"], r


def test_state_bytes_one_quarter_at_n4():
    (r,) = run_ranks(4, "memory.py", [256, 3])
    assert r["fsdp_state"] <= r["ddp_state"] * (1 / 4 + 0.02), r


@pytest.mark.parametrize("fully", [False, True])
def test_hybrid_shard_by_replica_on_mpi_4(fully):
    # fully: fully_shard(group=shard) too; the step all-sums the shards over the replicas
    (r,) = run_ranks(4, "hybrid.py", ["fully"] if fully else [])
    assert (r["shard_size"], r["replica_size"]) == (2, 2) and r["fully"] == fully
    assert r["max_diff"] <= F32_TOL, r
    assert r["state_fraction"] < 0.56, r
    assert (r["sharded_buckets"] > 0) == fully, r


@pytest.mark.parametrize("fully", [False, True])
def test_hybrid_with_muon_on_owners_in_shard_groups_of_3(fully):
    # 3 x 2 ranks: Muon's matrices whole on owners within each shard group
    # (each in an all-summed bucket of its own), then summed over the replicas.
    (r,) = run_ranks(6, "hybrid.py", ["fully", "muon", "shard=3"] if fully
                     else ["muon", "shard=3"])
    assert (r["shard_size"], r["replica_size"]) == (3, 2) and r["fully"] == fully
    assert r["max_diff"] <= F32_TOL, r
    assert (r["sharded_buckets"] > 0) == fully, r


def test_hybrid_on_ring_says_split_is_missing():
    (r,) = run_ranks(2, "hybrid.py")
    assert "Group.split" in r["error"] and "MPI or NCCL" in r["error"], r


def test_dropin_behaves_like_mlx_031():
    (r,) = run_ranks(2, "dropin.py")
    assert r["plain_is_tree"] and r["norm_shape"] == []
    assert r["max_diff"] <= F32_TOL and r["norm_err"] <= 1e-5, r


def test_compiled_step_equals_eager():
    configs = ["adamw:400", "multi:0", "adamw:400:2:sharded", "multi:0:2:local"]
    results = run_ranks(2, "compiled.py", configs)
    assert [r["config"] for r in results] == configs
    for r in results:
        # 5 calls: 5 steps, or with 2 micro-batches per step 2 steps and one more micro-batch.
        k = 2 if r["config"].count(":") == 3 else 1
        assert r["steps"] == r["eager_steps"] == 5 // k and r["micro"] == 5 % k, r
        # norm_err is relative; a compiled graph may sum the squares in another
        # order (float32: about n * 2**-24 for the 706 elements).
        assert r["max_diff"] <= F32_TOL and r["norm_err"] <= 706 * 2.0**-24, r


@pytest.mark.parametrize("kind", ["extra_array", "shape"])
def test_trees_differing_across_ranks_raise_on_every_rank(kind):
    code, out = run_ranks(2, "mismatch.py", [kind], timeout=120, expect_failure=True)
    for rank in (0, 1):
        assert (f"rank {rank}: RankMismatch: The ranks disagree in update: gradient tree and "
                "plan: rank 0 2 arrays, 120 elements") in out, out
    assert "NO ERROR" not in out


def test_init_builds_the_state_the_step_uses():
    (r,) = run_ranks(2, "init_state.py")
    # (7, 15) = 105 elements: with a 300-byte budget its own bucket, 53 + 52.
    # The scalar follows (15, 3) in its bucket, in rank 1's half: rank 0 holds
    # nothing of it and keeps no state for it.
    assert r["lengths"]["mix"] == 53 and "scale" not in r["lengths"], r
    assert r["fits_plan"] and r["same_state"] and r["max_diff"] == 0.0, r
