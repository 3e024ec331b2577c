"""The memory planner against every recorded measurement, re-planned now.

``benchmarks/records/plan_memory.jsonl`` holds the peaks that
``bench_plan_memory.py`` measured, rank by rank, with the point that made
each: the model, the optimizer, the mode, N and the run's settings (one
JSON object a line; the format is in ``benchmarks/records/README.md``).
This script plans every point again with this checkout's planner, as
``bench_plan_memory.py`` planned it when it measured it, and prints, per
set (``ddp_step``, ``fsdp_step`` and fully sharded, eager and compiled),
how far the plan is above the measured peak: that of the fullest rank
(planned / measured), and whether any rank peaked above its own plan.
No step runs: it takes about 20 s on two CPU cores.

    python benchmarks/replan_records.py
    python benchmarks/replan_records.py --closest 10 --check
    python benchmarks/replan_records.py --by size

``--by`` groups the rows by set (the default), by optimizer, or by the
measured peak's size (the fullest rank's), the CPU's points paced or
compiled apart from the rest: how close the plan is on the steps a user
plans for, not only on the small models that most points measure.

``--check`` exits with status 1 if any rank was measured above its plan:
a planner change that does so has lost the upper bound somewhere it held.
"""

import argparse
import json
import os
import statistics
import sys
from contextlib import contextmanager
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_plan_memory as bpm  # noqa: E402  (puts the package on the path)

from mlx_fsdp import pace  # noqa: E402
from mlx_fsdp.plan_memory import estimate, shapes  # noqa: E402

RECORDS = os.path.join(HERE, "records", "plan_memory.jsonl")
#: The plan's aim: at most this much above the measured peak.
TIGHT = 1.3


def load(path: str = RECORDS) -> List[dict]:
    """The records, one dict per measured point."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@contextmanager
def _paced(on: bool):
    # A point measured with --unpaced was planned with the CPU's pacing off.
    depth = pace.QUEUE_DEPTH
    pace.QUEUE_DEPTH = depth if on else 0
    try:
        yield
    finally:
        pace.QUEUE_DEPTH = depth


def replan(record: dict, models: Dict[tuple, object] = None) -> List[int]:
    """Each rank's planned peak in bytes for one record, with this checkout's planner.

    ``models``: a cache of the models' shapes, shared across calls.
    Default: ``None`` (none kept).
    """
    args = bpm.parse_args([])
    vars(args).update(record["config"])
    name, n = record["model"], record["n"]
    key = (name, args.hidden, args.layers, args.dims, args.gpt_layers, args.dtype)
    models = {} if models is None else models
    if key not in models:
        models[key] = shapes.from_tree(bpm.build(name, args), name)
    options = bpm.plan_options(args, record["reshard_after_forward"], record["activations"],
                               record["device"], record["reduce_scatter"])
    with _paced(not args.unpaced):
        ranks = estimate(models[key], record["optimizer"], record["mode"], n, **options)
    peaks = [r.peak for r in ranks]
    return peaks * n if len(peaks) == 1 else peaks  # ddp_step: one plan for every rank


def set_of(record: dict) -> str:
    """The row of the table a record counts in."""
    mode = {"ddp": "ddp_step", "fsdp": "fsdp_step", "fully_shard": "fully sharded"}
    config = record["config"]
    how = "compiled" if config["compile"] else "unpaced" if config.get("unpaced") else "eager"
    where = ", on a GPU" if record["device"] == "gpu" else ""
    return (f"{mode[record['mode']]}, {how}" if record["mode"] != "ddp" else mode["ddp"]) + where


def ratios(record: dict, planned: List[int]) -> tuple:
    """``(fullest, closest)``: the fullest rank's plan over its peak, and the
    least of each rank's plan over its own peak."""
    measured = record["measured"]
    return (max(planned) / max(measured),
            min(p / m for p, m in zip(planned, measured)))


#: ``--by size``: the bands of the fullest rank's measured peak, in MiB.
SIZES = (16, 64)


def group_of(record: dict, by: str) -> str:
    """The row a record counts in, grouped ``by`` ``"set"``, ``"optimizer"`` or
    ``"size"``: the optimizer, or the band of its measured peak, of the CPU's
    paced and compiled points, with the unpaced and the GPU's apart."""
    if by == "set":
        return set_of(record)
    if record["device"] == "gpu" or record["config"].get("unpaced"):
        return "unpaced or on a GPU"
    if by == "optimizer":
        return record["optimizer"]
    mib = max(record["measured"]) / 2**20
    return bands()[sum(mib >= s for s in SIZES)]


def bands() -> List[str]:
    """The names of the ``--by size`` rows, smallest first."""
    edges = list(zip(SIZES, SIZES[1:]))
    return [f"under {SIZES[0]} MiB", *(f"{a} to {b} MiB" for a, b in edges),
            f"{SIZES[-1]} MiB and more"]


def summary(name: str, rows: List[tuple]) -> str:
    """One markdown row: points, the range and median of planned / measured,
    how many above :data:`TIGHT`, and how many with a rank above its plan."""
    full = [f for f, _ in rows]
    above = sum(f > TIGHT for f in full)
    below = sum(c < 1 for _, c in rows)
    return (f"| {name} | {len(rows)} | {min(full):.3f}x to {max(full):.3f}x | "
            f"{statistics.median(full):.3f}x | {above} | {below} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", default=RECORDS, help="the JSON-lines file (default: the "
                   "repository's benchmarks/records/plan_memory.jsonl)")
    p.add_argument("--closest", type=int, default=5,
                   help="also list the points whose closest rank is nearest its plan "
                   "(default 5)")
    p.add_argument("--by", choices=("set", "optimizer", "size"), default="set",
                   help="the rows: per set, per optimizer or per band of the measured peak "
                   "(the CPU's paced and compiled points; default set)")
    p.add_argument("--check", action="store_true",
                   help="exit with status 1 if any rank was measured above its plan")
    args = p.parse_args(argv)
    records, models, rows = load(args.records), {}, []
    for record in records:
        rows.append((record, ratios(record, replan(record, models))))
    sets = {}
    for record, r in rows:
        sets.setdefault(group_of(record, args.by), []).append(r)
    print(f"{len(rows)} recorded points ({args.records}), re-planned with this checkout's "
          "planner; planned / measured peak of the fullest rank:")
    print(f"| {args.by} | points | planned / measured | median | above {TIGHT}x | "
          "a rank above its plan |")
    print("|---|---:|---|---:|---:|---:|")
    order = bands() if args.by == "size" else sorted(sets)
    for name in [n for n in order if n in sets] + sorted(set(sets) - set(order)):
        print(summary(name, sets[name]))
    print(summary("all", [r for _, r in rows]))
    if args.closest:
        print(f"closest ranks (a rank's plan / its measured peak), {args.closest} nearest:")
    for record, (_, closest) in sorted(rows, key=lambda x: x[1][1])[:args.closest]:
        print(f"  {closest:.4f}  {describe(record)}")
    if args.check and any(c < 1 for _, (_, c) in rows):
        sys.exit(1)


def describe(record: dict) -> str:
    """A record's point, as the command that measured it would name it."""
    c = record["config"]
    shape = {"mlp": f"{c['layers']}x{c['hidden']}"}.get(record["model"],
                                                         f"{c['gpt_layers']}x{c['dims']}")
    flags = [f for f, on in (("on a GPU", record["device"] == "gpu"), ("compiled", c["compile"]),
                             ("unpaced", c.get("unpaced", False)),
                             (c["dtype"], c["dtype"] != "float32"),
                             ("reshard", record["reshard_after_forward"]),
                             (f"max-norm {c['max_norm']}", c["max_norm"] is not None),
                             (f"accumulation {c['accumulation']}", c["accumulation"] != "none"),
                             (f"buckets {c['communication_size']} B",
                              c["communication_size"] is not None)) if on]
    return (f"{record['model']} {shape} {record['optimizer']} {record['mode']} "
            f"N={record['n']} ({record['backend']}){''.join(', ' + f for f in flags)}")


if __name__ == "__main__":
    main()
