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

# case -> the words the error must carry on every rank
DISAGREEMENTS = {
    "learning_rate": "learning rate of this step: ranks? 0(, 1)? 0.001, rank [12] 0.002",
    "schedule": "learning rate of this step: ranks? 0(, 1)? 0.001, rank [12] 0.002",
    "optimizer_class": r"optimizer and hyper-parameters: ranks? 0(, 1)? AdamW\(.*\), rank [12] SGD\(",
    "hyperparameter": "weight_decay=0.01.*weight_decay=0.1",
    "max_norm": "max_norm: ranks? 0(, 1)? 1, rank [12] None",
    "accumulation_steps": "grad_accumulation_steps: ranks? 0(, 1)? 2, rank [12] 3",
    "tree_changes": "gradient tree and plan: ranks? 0(, 1)? 11 arrays.*rank [12] 10 arrays",
    "ddp_tree": "gradient tree and plan: ranks? 0(, 1)? 11 arrays.*rank [12] 10 arrays",
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


@pytest.mark.parametrize("n, backend", BACKENDS)
def test_a_rank_that_skips_an_update_ends_the_job_with_a_message(n, backend):
    # The last rank skips its last update and exits. The others wait in the
    # step's check for it: a lost peer (ring) or the watchdog (MPI: a rank that
    # finalizes leaves the others waiting) ends them with a message naming update.
    start = time.monotonic()
    code, out = run_ranks(n, "faults.py", ["one_update_fewer", 4], backend=backend, timeout=120,
                          expect_failure=True)
    assert ("PeerLost: A peer left while this rank" in out and "must call update" in out) or (
        "[mlx_fsdp watchdog]" in out and "of step 2" in out), out
    assert time.monotonic() - start < 90, "the job must end within the timeout plus a few seconds"


@pytest.mark.parametrize("n, backend", BACKENDS)
def test_a_stopped_rank_ends_the_job_through_the_watchdog(n, backend):
    # The last rank SIGSTOPs itself after step 1: the others wait, the watchdog
    # (3 s) names the step and the wait, and exits with 124; the launcher
    # stops the job, the stopped rank included.
    start = time.monotonic()
    code, out = run_ranks(n, "faults.py", ["stop", 3], backend=backend, timeout=120,
                          expect_failure=True)
    assert "[mlx_fsdp watchdog] rank 0 waited" in out, out
    assert "in the cross-rank check of step 2" in out and "exit code 124" in out, out
    assert time.monotonic() - start < 60, "the job must end within the timeout plus a few seconds"
