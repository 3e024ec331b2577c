"""Ranks that disagree, skip a call, stop or die: the same clear error on every rank, never a hang.

Every case runs on real ranks, ring N=2 and MPI N=3, under the suite's hard
timeout (a hang fails the test with ``HANG``). The checkpoint cases are in
``test_checkpoint_faults.py``.
"""

import re
import time

import pytest

from launch import run_ranks

BACKENDS = [(2, "ring"), (3, "mpi")]

# case -> the words the error must carry on every rank. Lazy ``.*?``: under
# mpirun two ranks' messages can land on one line, and a greedy match would
# count them as one.
DISAGREEMENTS = {
    "learning_rate": "learning rate of this step: ranks? 0(, 1)? 0.001, rank [12] 0.002",
    "schedule": "learning rate of this step: ranks? 0(, 1)? 0.001, rank [12] 0.002",
    "optimizer_class": r"optimizer and hyper-parameters: ranks? 0(, 1)? AdamW\(.*?\), rank [12] SGD\(",
    "hyperparameter": "weight_decay=0.01.*?weight_decay=0.1",
    "max_norm": "max_norm: ranks? 0(, 1)? 1, rank [12] None",
    "accumulation_steps": "grad_accumulation_steps: ranks? 0(, 1)? 2, rank [12] 3",
    "tree_changes": "gradient tree and plan: ranks? 0(, 1)? 11 arrays.*?rank [12] 10 arrays",
    "ddp_tree": "gradient tree and plan: ranks? 0(, 1)? 11 arrays.*?rank [12] 10 arrays",
    "resumed_differently": "optimizer step count: ranks? 0(, 1)? 2, rank [12] 0",
}


@pytest.mark.parametrize("n, backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(DISAGREEMENTS))
def test_ranks_that_disagree_get_the_same_error_and_keep_their_state(case, n, backend):
    code, out = run_ranks(n, "faults.py", [case], backend=backend, timeout=120, expect_failure=True)
    assert "NO ERROR" not in out, out  # (mlx.launch exits 0 even when a rank fails)
    for rank in range(n):
        # Searched in the whole output: under mpirun, ranks' lines may interleave.
        assert f"rank {rank}: RankMismatch: The ranks disagree in update" in out, out
        assert f"rank {rank}: unchanged=True" in out, out
    assert len(re.findall(DISAGREEMENTS[case], out)) >= n, out


#: The watchdog's timeout in the launches below, set as a cluster script would:
#: MLX_FSDP_TIMEOUT, for every wrapper of the job (the scripts pass no timeout=).
SHORT = {"MLX_FSDP_TIMEOUT": "2"}
HARNESS_KILLED = "the test harness killed it"


def _watchdog_ended(out, ranks, where):
    """Every waiting rank printed the watchdog's message, and the line scripts look for."""
    for rank in ranks:
        assert re.search(rf"\[mlx_fsdp watchdog\] rank {rank} waited \d+ s \(timeout 2 s\) in "
                         rf"{where}", out), (rank, out)
        assert f"[mlx_fsdp] FAILED: rank {rank} exits with code 124 (watchdog)." in out, out
    assert HARNESS_KILLED not in out, out  # mpirun exited by itself


@pytest.mark.parametrize("n, backend", BACKENDS)
def test_a_rank_that_skips_an_update_and_exits_ends_the_job_at_once(n, backend):
    # The last rank skips its last update and exits. Ring: the others' check
    # loses its peer. MPI: the exiting rank meets the others' check before
    # MPI_Finalize (mlx_fsdp/ending.py), so every rank gets the same error.
    start = time.monotonic()
    code, out = run_ranks(n, "faults.py", ["one_update_fewer"], backend=backend, timeout=120,
                          expect_failure=True, env=SHORT)
    assert code != 0, out
    if backend == "ring":
        assert "rank 0: PeerLost: A peer left while this rank" in out and "must call update" in out
    else:
        for rank in range(n):
            assert (f"rank {rank}: RankMismatch: The ranks are at different synchronization "
                    "points: ranks 0, 1 in update; rank 2 in exit. The script of rank 2 ended") in out
        assert "[mlx_fsdp] FAILED: rank 2 exits with code 1." in out, out
        assert HARNESS_KILLED not in out, out
    assert time.monotonic() - start < 60, "the job must end at once, not after the timeout"


def test_an_error_on_one_rank_ends_the_job_at_once_under_mpi():
    # The failing rank leaves without MPI_Finalize, whose wait for every rank
    # would keep the others waiting until their watchdog (60 s here) ends them.
    start = time.monotonic()
    code, out = run_ranks(3, "faults.py", ["raises"], timeout=120, expect_failure=True,
                          env={"MLX_FSDP_TIMEOUT": "60"})
    assert code != 0 and "ZeroDivisionError" in out, out
    assert "[mlx_fsdp] FAILED: rank 2 exits with ZeroDivisionError: division by zero" in out, out
    assert "watchdog]" not in out and HARNESS_KILLED not in out, out
    assert time.monotonic() - start < 30, "the job must end at once, not after the timeout"


@pytest.mark.parametrize("n, backend", BACKENDS)
def test_a_stopped_rank_ends_the_job_through_the_watchdog(n, backend):
    # The last rank SIGSTOPs itself after step 1: every other rank waits in
    # the check of step 2, and its watchdog (timeout=2 here) names the wait
    # and exits with 124; the launcher stops the job, the stopped rank included.
    start = time.monotonic()
    code, out = run_ranks(n, "faults.py", ["stop", 2], backend=backend, timeout=120,
                          expect_failure=True)
    assert code != 0, out
    _watchdog_ended(out, range(n - 1), "the cross-rank check of step 2")
    assert time.monotonic() - start < 60, "the job must end within the timeout plus a few seconds"


@pytest.mark.parametrize("n, backend", BACKENDS)
def test_a_collective_of_the_users_own_after_a_skipped_update_ends_on_every_rank(n, backend):
    # The cross-rank check cannot see an all_sum of the user's own: the last
    # rank waits in it, the others in the check of the update it skipped.
    code, out = run_ranks(n, "faults.py", ["user_collective"], backend=backend, timeout=120,
                          expect_failure=True, env=SHORT)
    assert code != 0, out
    _watchdog_ended(out, range(n - 1), "the cross-rank check of step 1")
    _watchdog_ended(out, [n - 1], "a collective evaluated after update of step 0 returned")


@pytest.mark.parametrize("n, backend", BACKENDS)
def test_a_rank_stopped_before_a_fully_sharded_forward_pass_ends_the_job(n, backend):
    # The gathers of a fully sharded model run in the caller's evaluation,
    # before any update: the module watches them itself.
    code, out = run_ranks(n, "faults.py", ["fully_sharded_stop"], backend=backend, timeout=120,
                          expect_failure=True, env=SHORT)
    assert code != 0, out
    _watchdog_ended(out, range(n - 1), r"the collectives of fully sharded OddModel \(its forward")


def test_long_legitimate_waits_do_not_end_the_job():
    # A step that computes for longer than the timeout, a validation loop
    # longer than the timeout, a checkpoint save and load: no watchdog.
    code, out = run_ranks(2, "faults.py", ["legitimate"], timeout=120, expect_failure=True,
                          env=SHORT)
    assert code == 0 and "watchdog" not in out, out
    assert "rank 0: NO ERROR" in out and "rank 1: NO ERROR" in out, out
