"""The memory planner against every recorded measurement (benchmarks/records).

Each record is a peak that ``bench_plan_memory.py`` measured on real ranks,
rank by rank; re-planned with this checkout's planner, no rank may have
peaked above its plan. A planner change that lowers a count below a peak
once measured fails here, without running a step.
"""

import importlib.util
import json
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


def test_the_plan_is_closest_on_the_largest_steps(replanned):
    """On the CPU's paced and compiled points, the steps that peaked at 64 MiB or
    more, which most resemble what a user plans for, read closest: held where
    they stand (2026-12-01, session 53: 158 points, median 1.198x, 24 above
    1.3x), as ``replan_records.py --by size`` prints them."""
    large = [max(p) / max(r["measured"]) for r, p in replanned
             if rr.group_of(r, "size") == "64 MiB and more"]
    assert len(large) >= 100
    assert statistics.median(large) <= 1.20
    assert sum(f > rr.TIGHT for f in large) <= 0.16 * len(large)


def test_replan_groups_points_by_size_and_by_optimizer(tmp_path, capsys):
    """``--by size`` puts a point in the band of its fullest rank's measured peak,
    ``--by optimizer`` under its optimizer, each with the CPU's unpaced and the
    GPU's points apart; every point is counted once."""
    def record(peak_mib, device="cpu", unpaced=False):
        return {"device": device, "optimizer": "sgd", "measured": [1, int(peak_mib * 2**20)],
                "config": {"unpaced": unpaced}}
    bands = [rr.group_of(record(m), "size") for m in (3, 16, 40, 64, 300)]
    assert bands == ["under 16 MiB", "16 to 64 MiB", "16 to 64 MiB", "64 MiB and more",
                     "64 MiB and more"]
    assert rr.group_of(record(300, "gpu"), "size") == "unpaced or on a GPU"
    assert rr.group_of(record(3, unpaced=True), "optimizer") == "unpaced or on a GPU"
    assert rr.group_of(record(3), "optimizer") == "sgd"

    few = [r for r in rr.load() if r["model"] == "mlp"][:3]
    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in few))
    rr.main(["--records", str(path), "--by", "size", "--closest", "0"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| size |")
    counts = [int(row.split("|")[2]) for row in rows[1:-1]]
    assert sum(counts) == int(rows[-1].split("|")[2]) == 3
