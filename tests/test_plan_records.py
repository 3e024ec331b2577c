"""The memory planner against every recorded measurement (benchmarks/records).

Each record is a peak that ``bench_plan_memory.py`` measured on real ranks,
rank by rank; re-planned with this checkout's planner, no rank may have
peaked above its plan. A planner change that lowers a count below a peak
once measured fails here, without running a step.
"""

import importlib.util
import statistics
import sys

import pytest

sys.path.insert(0, "benchmarks")
import replan_records as rr  # noqa: E402

HAVE_MLX_LM = importlib.util.find_spec("mlx_lm") is not None


@pytest.fixture(scope="module")
def replanned():
    """``(record, planned peaks by rank)`` for every record this machine can build."""
    models = {}
    return [(r, rr.replan(r, models)) for r in rr.load()
            if HAVE_MLX_LM or r["model"] != "llama"]


def test_records_cover_every_mode_optimizer_and_model():
    """The records span what the planner is used for: every wrapper, eager and
    compiled, every optimizer, the three models, float32 and bfloat16, and N
    from 2 to 8 over ring and MPI, compiled steps too (before session 48 no
    compiled point had N above 4, and the first at N=8 peaked above the plan)."""
    records = rr.load()
    assert len(records) >= 1200
    assert {rr.set_of(r) for r in records} == {
        "ddp_step", "fsdp_step, eager", "fsdp_step, compiled", "fsdp_step, unpaced",
        "fully sharded, eager", "fully sharded, compiled", "fully sharded, unpaced",
        "ddp_step, on a GPU", "fsdp_step, eager, on a GPU"}
    assert {r["optimizer"] for r in records} == {"adamw", "adam", "sgd", "lion", "muon",
                                                 "adafactor"}
    assert {r["model"] for r in records} == {"mlp", "gpt", "llama"}
    assert {r["config"]["dtype"] for r in records} == {"float32", "bfloat16"}
    assert {r["n"] for r in records} == set(range(2, 9))
    assert {r["n"] for r in records if r["config"]["compile"]} == set(range(2, 9))
    assert all(len(r["measured"]) == r["n"] for r in records)


def test_every_recorded_rank_peaked_below_its_plan(replanned):
    """Measured <= planned, rank by rank, on every record (the plan's upper bound)."""
    above = [f"{min(p / m for p, m in zip(planned, r['measured'])):.4f} {rr.describe(r)}"
             for r, planned in replanned if any(m > p for p, m in zip(planned, r["measured"]))]
    assert not above, "measured above the plan:\n" + "\n".join(above)


def test_the_plan_stays_as_close_as_recorded(replanned):
    """How far above the peaks the plan is, held where it stands (2026-12-01,
    session 51, the compiled counts refitted): median 1.231x (1.242x in
    session 50); the loosest 2.25x (a compiled ``fsdp_step``
    with an all-summed owner bucket, counted unpaced since one peaked above
    its paced count at MPI N=7; 1.98x before), or 3.16x with the CPU's
    pacing off (``--unpaced``, which a GPU's unpaced step is planned like:
    both phases at once). The loosest was 2.70x before session 49 (the MLP 4
    x 512 with Adafactor, fully sharded and compiled whole, at MPI N=5 to 8,
    whose owner buckets were counted queued ahead). A change that loosens
    the plan broadly shows here; the issue's aim, every point within 1.3x,
    is not met (the loosest are small models with Muon, Adafactor and Lion).
    On a GPU (24 points on an H200, 2026-12-01) up to 4.66x: Muon, whose
    three cuBLASLt workspaces the plan counts whole beside matrices of 128."""
    def kind(r):
        return "gpu" if r["device"] == "gpu" else (
            "unpaced" if r["config"].get("unpaced", False) else "paced")

    fullest = [(max(p) / max(r["measured"]), kind(r)) for r, p in replanned]
    assert statistics.median(f for f, k in fullest if k == "paced") <= 1.24
    assert max(f for f, k in fullest if k == "paced") <= 2.25
    assert max(f for f, k in fullest if k == "unpaced") <= 3.25
    assert max(f for f, k in fullest if k == "gpu") <= 5.0
