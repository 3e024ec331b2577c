"""Train the same model with DDP, FSDP and fully sharded FSDP, in one launch, and compare.

Four runs start from the same seed and see the same global batches (each
rank its own slice): DDP; FSDP (``fsdp_step``: the optimizer state and the
update sharded); fully sharded (``fully_shard`` on every block and the whole
model, then ``fsdp_step``: the parameters and gradients sharded too); then
DDP again. They run one after the other, so each mode's peak memory is its
own. By default the model is a 3.7M-parameter GPT (width 384, 2 blocks) on
global batches of 4 rows of 16 bytes, 30 steps of AdamW at 5e-4: its
parameters, gradients and optimizer state, not its activations, fill most
of a rank's memory, so the sharded modes' saving shows in the peak. The second DDP run measures the noise floor: where reductions are not
bitwise deterministic (GPUs), two DDP runs of one configuration drift apart,
and FSDP cannot be asked to track DDP more closely than DDP tracks itself.
Both sharded modes are judged against the larger of the fixed tolerance
(1e-3) and that floor; on the CPU the floor is 0 and the tolerance applies.
The result goes to ``--out``:

* ``compare.json``: ``{"ddp": {"loss": [...], "step_ms": [...], "peak_memory": ...},
  "fsdp": {...}, "fully_shard": {...}, "ddp_repeat": {...}, "config": {...},
  "max_abs_diff": ..., "noise_floor": ..., "tolerance": ..., "limit": ...,
  "limit_source": ...}`` (``max_abs_diff``: the larger of the two sharded modes');
* ``compare.png``: the loss curves, and below them each mode - DDP and DDP -
  DDP per step (needs matplotlib: ``pip install -e '.[plot]'``).

Rank 0 prints a progress line every ``--log-every`` steps of each run, then a
table: final losses, median step time, peak memory, parameters and optimizer
state per rank for each mode, the largest per-step difference from DDP and
the noise floor it was judged against.

    mlx.launch -n 2 --backend ring -- python examples/compare_ddp_fsdp.py --steps 20 --out runs/compare

Every training flag of ``train.py`` applies (``--optimizer muon``,
``--dtype bfloat16``, ``--max-norm``, ...).
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lm  # noqa: E402

#: FSDP and DDP losses should agree to this at every step (float32), or to the
#: noise floor where that is larger.
TOLERANCE = 1e-3
#: The runs, in the order they train; the second DDP run gives the noise floor.
RUNS = (("ddp", "ddp"), ("fsdp", "fsdp"), ("fully_shard", "fully_shard"), ("ddp_repeat", "ddp"))
#: The modes compared with DDP.
SHARDED = ("fsdp", "fully_shard")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="compare_out", help="output folder (default ./compare_out)")
    lm.add_training_args(p)
    # A wide, shallow model on short rows: its parameters and optimizer state,
    # not its activations, fill the memory, so the sharded modes' saving shows
    # (train.py's defaults are activation-bound: 0.13M parameters). Four
    # rows keep the four runs near 90 s on 2 CPU cores, where mlx's Linux
    # wheel multiplies through the reference BLAS (8 rows took about 170 s).
    p.set_defaults(steps=30, dims=384, layers=2, batch_size=4, seq_len=16)
    args = p.parse_args(argv)
    if args.learning_rate is None and args.optimizer == "adamw":
        args.learning_rate = 5e-4  # AdamW's 3e-3 makes this wider model's first steps climb
    lm.check_args(p, args)
    return args


#: How the table and the plot name each mode.
NAMES = {"ddp": "DDP", "fsdp": "FSDP", "fully_shard": "fully sharded"}


def summarize(runs: dict) -> dict:
    """Per-mode figures, each sharded mode's and the second DDP run's differences from DDP, the verdict.

    Returns:
        dict: ``diff`` (``{mode: per-step mode - DDP}`` for the sharded modes
        in ``runs``), ``worst`` (their largest absolute values), ``max_abs_diff``
        (the largest of those), ``floor_diff`` and ``noise_floor`` (second DDP
        - DDP), ``limit`` (the larger of :data:`TOLERANCE` and the floor),
        ``limit_source`` (``"tolerance"`` or ``"noise floor"``), ``within``
        and ``modes`` (the table's rows).
    """
    diff = {m: [f - d for d, f in zip(runs["ddp"]["loss"], runs[m]["loss"])]
            for m in SHARDED if m in runs}
    worst = {m: max(abs(d) for d in values) for m, values in diff.items()}
    floor_diff = [r - d for d, r in zip(runs["ddp"]["loss"], runs["ddp_repeat"]["loss"])]
    floor = max(abs(d) for d in floor_diff)
    limit, source = (floor, "noise floor") if floor > TOLERANCE else (TOLERANCE, "tolerance")
    rows = {}
    for mode in ("ddp", *diff):
        run = runs[mode]
        # The first step includes building the plan and warming the caches.
        times = run["step_ms"][1:] or run["step_ms"]
        rows[mode] = {"final_loss": run["loss"][-1], "first_loss": run["loss"][0],
                      "median_step_ms": statistics.median(times),
                      "peak_memory": run["peak_memory"], "state_bytes": run["state_bytes"],
                      "param_bytes": run.get("param_bytes")}
    largest = max(worst.values())
    return {"diff": diff, "worst": worst, "max_abs_diff": largest, "floor_diff": floor_diff,
            "noise_floor": floor, "limit": limit, "limit_source": source,
            "within": largest <= limit, "modes": rows}


def _limit_name(summary: dict) -> str:
    if summary["limit_source"] == "noise floor":
        return f"the noise floor (larger than the tolerance {TOLERANCE:g})"
    return f"the tolerance {TOLERANCE:g} (larger than the noise floor)"


def _mib(value) -> str:
    return "-" if value is None else f"{value / 1024**2:.3f}"


def table(summary: dict, n: int) -> str:
    """The comparison as a markdown table plus the verdict lines."""
    lines = ["| mode | first loss | final loss | median step ms | peak MiB | "
             "parameters MiB/rank | optimizer state MiB/rank |",
             "|------|-----------:|-----------:|---------------:|---------:|"
             "--------------------:|-------------------------:|"]
    for mode, r in summary["modes"].items():
        lines.append(f"| {mode} | {r['first_loss']:.4f} | {r['final_loss']:.4f} | "
                     f"{r['median_step_ms']:.1f} | {r['peak_memory'] / 1024**2:.1f} | "
                     f"{_mib(r['param_bytes'])} | {_mib(r['state_bytes'])} |")
    lines.append("")
    for mode, worst in summary["worst"].items():
        verdict = "within" if worst <= summary["limit"] else "ABOVE"
        lines.append(f"max |{NAMES[mode]} - DDP| loss over all steps: {worst:.2e} "
                     f"({verdict} {summary['limit']:g})")
    lines.append(f"noise floor, max |DDP - DDP| loss of two DDP runs with the same seed: "
                 f"{summary['noise_floor']:.2e}; FSDP judged against {_limit_name(summary)}")
    d = summary["modes"]["ddp"]
    for mode in summary["worst"]:
        r = summary["modes"][mode]
        params = (f"parameters {r['param_bytes'] / d['param_bytes']:.3f}x, "
                  if mode == "fully_shard" and r["param_bytes"] and d["param_bytes"] else "")
        lines.append(f"{NAMES[mode]} / DDP: {params}optimizer state "
                     f"{r['state_bytes'] / d['state_bytes']:.3f}x (ideal 1/{n}), "
                     f"peak memory {r['peak_memory'] / d['peak_memory']:.3f}x, "
                     f"median step time {r['median_step_ms'] / d['median_step_ms']:.3f}x")
    return "\n".join(lines)


def plot(path: str, runs: dict, summary: dict, title: str) -> bool:
    """Write the two-panel figure; return False (and write nothing) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    first = runs["ddp"]["first_step"] + 1
    steps = list(range(first, first + len(runs["ddp"]["loss"])))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    style = {"fsdp": dict(color="tab:red", ls="--", marker="o"),
             "fully_shard": dict(color="tab:green", ls="-.", marker="s")}
    top.plot(steps, runs["ddp"]["loss"], color="tab:blue", lw=3.5, alpha=0.45, label="DDP")
    for mode in summary["diff"]:
        top.plot(steps, runs[mode]["loss"], lw=1.2, ms=2.5, label=NAMES[mode], **style[mode])
    top.plot(steps, runs["ddp_repeat"]["loss"], color="black", lw=0.8, ls=":",
             label="DDP again (same seed)")
    top.set_ylabel("training loss (nats / byte)")
    top.set_title(title, fontsize=10)
    limit = summary["limit"]
    top.legend(title=f"curves agree to {limit:g}" if summary["within"] else f"curves differ by > {limit:g}",
               title_fontsize=8)
    top.grid(alpha=0.3)

    bottom.axhline(0.0, color="black", lw=0.8)
    for bound in (limit, -limit):
        bottom.axhline(bound, color="tab:gray", lw=0.8, ls=":")
    bottom.plot(steps, summary["floor_diff"], color="tab:gray", lw=2.5, alpha=0.5,
                label="DDP − DDP (noise floor)")
    for mode, diff in summary["diff"].items():
        bottom.plot(steps, diff, lw=1, ms=3, label=f"{NAMES[mode]} − DDP", **style[mode])
    largest = max(summary["max_abs_diff"], summary["noise_floor"])
    span = max(largest * 1.3, 1e-7)
    name = "noise floor" if summary["limit_source"] == "noise floor" else "tolerance"
    if span < limit:
        # Zoom on the differences; say where the limit lies instead of drawing it off-scale.
        bottom.set_ylim(-span, span)
        note = f"{name} ±{limit:.2g} is off this scale"
    else:
        note = f"dotted: {name} ±{limit:.2g}"
    if largest == 0:
        note = "identical losses at every step"
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    bottom.set_ylabel("loss difference")
    bottom.set_xlabel("optimizer step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.legend(fontsize=8)
    worst = ", ".join(f"max |{NAMES[m]} − DDP| = {w:.1e}" for m, w in summary["worst"].items())
    bottom.set_title(f"per step: {worst}, max |DDP − DDP| = {summary['noise_floor']:.1e} ({note})",
                     fontsize=9)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None):
    args = parse_args(argv)
    group = lm.init_distributed()
    rank, n = group.rank(), group.size()
    data = lm.load_corpus(args.data, args.max_data_bytes)
    if rank == 0:
        print(f"DDP vs FSDP on {lm.plural(n, 'rank')}: {args.steps} steps, global batch "
              f"{args.batch_size} x {args.seq_len} bytes, {lm.describe_rates(args)}, {args.dtype}, "
              f"max_norm {args.max_norm:g}, {lm.describe_model(args)}; runs DDP, FSDP, fully "
              "sharded, then DDP again for the noise floor",
              flush=True)
    runs = {name: lm.train(mode, args, data, group, tag=name,
                           checkpoint_dir=os.path.join(args.checkpoint_dir, name))
            for name, mode in RUNS}
    if rank != 0:
        return
    summary = summarize(runs)
    config = {k: v for k, v in vars(args).items()}
    config.update(world_size=n, params=runs["ddp"]["params"], data_bytes=int(len(data)))
    os.makedirs(args.out, exist_ok=True)
    verdict = {k: summary[k] for k in ("max_abs_diff", "noise_floor", "limit", "limit_source", "within")}
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump({**runs, "config": config, "tolerance": TOLERANCE, **verdict}, f, indent=1)
    title = (f"DDP vs FSDP vs fully sharded, {lm.plural(n, 'rank')}: "
             f"{runs['ddp']['params'] / 1e6:.2f}M-parameter byte GPT, "
             f"{args.optimizer}, {args.dtype}, global batch {args.batch_size}x{args.seq_len}")
    png = os.path.join(args.out, "compare.png")
    print()
    print(table(summary, n))
    print()
    if plot(png, runs, summary, title):
        print(f"wrote {os.path.join(args.out, 'compare.json')} and {png}")
    else:
        print(f"wrote {os.path.join(args.out, 'compare.json')}; no plot: matplotlib is not "
              "installed (pip install -e '.[plot]' or pip install matplotlib)")


if __name__ == "__main__":
    main()
