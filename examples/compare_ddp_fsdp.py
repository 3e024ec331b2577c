"""Train the same model with DDP and with FSDP, in one launch, and compare.

Three runs start from the same seed and see the same global batches (each rank
its own slice): DDP, FSDP, then DDP again. They run one after the other, so
each mode's peak memory is its own. The second DDP run measures the noise
floor: where reductions are not bitwise deterministic (GPUs), two DDP runs of
one configuration drift apart, and FSDP cannot be asked to track DDP more
closely than DDP tracks itself. FSDP is judged against the larger of the fixed
tolerance (1e-3) and that floor; on the CPU the floor is 0 and the tolerance
applies. The result goes to ``--out``:

* ``compare.json``: ``{"ddp": {"loss": [...], "step_ms": [...], "peak_memory": ...},
  "fsdp": {...}, "ddp_repeat": {...}, "config": {...}, "max_abs_diff": ...,
  "noise_floor": ..., "tolerance": ..., "limit": ..., "limit_source": ...}``;
* ``compare.png``: the loss curves, and below them FSDP - DDP and DDP - DDP
  per step (needs matplotlib: ``pip install -e '.[plot]'``).

Rank 0 prints a progress line every ``--log-every`` steps of each run, then a
table: final losses, median step time, peak memory and optimizer state per
rank for each mode, the largest per-step FSDP - DDP difference and the noise
floor it was judged against.

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
RUNS = (("ddp", "ddp"), ("fsdp", "fsdp"), ("ddp_repeat", "ddp"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="compare_out", help="output folder (default ./compare_out)")
    lm.add_training_args(p)
    p.set_defaults(steps=50)
    args = p.parse_args(argv)
    lm.check_args(p, args)
    return args


def summarize(runs: dict) -> dict:
    """Per-mode figures, the per-step FSDP - DDP and DDP - DDP differences, and the verdict.

    Returns:
        dict: ``diff`` and ``max_abs_diff`` (FSDP - DDP), ``floor_diff`` and
        ``noise_floor`` (second DDP - DDP), ``limit`` (the larger of
        :data:`TOLERANCE` and the floor), ``limit_source`` (``"tolerance"`` or
        ``"noise floor"``), ``within`` and ``modes`` (the table's rows).
    """
    diff = [f - d for d, f in zip(runs["ddp"]["loss"], runs["fsdp"]["loss"])]
    floor_diff = [r - d for d, r in zip(runs["ddp"]["loss"], runs["ddp_repeat"]["loss"])]
    worst, floor = max(abs(d) for d in diff), max(abs(d) for d in floor_diff)
    limit, source = (floor, "noise floor") if floor > TOLERANCE else (TOLERANCE, "tolerance")
    rows = {}
    for mode in ("ddp", "fsdp"):
        run = runs[mode]
        # The first step includes building the plan and warming the caches.
        times = run["step_ms"][1:] or run["step_ms"]
        rows[mode] = {"final_loss": run["loss"][-1], "first_loss": run["loss"][0],
                      "median_step_ms": statistics.median(times),
                      "peak_memory": run["peak_memory"], "state_bytes": run["state_bytes"]}
    return {"diff": diff, "max_abs_diff": worst, "floor_diff": floor_diff, "noise_floor": floor,
            "limit": limit, "limit_source": source, "within": worst <= limit, "modes": rows}


def _limit_name(summary: dict) -> str:
    if summary["limit_source"] == "noise floor":
        return f"the noise floor (larger than the tolerance {TOLERANCE:g})"
    return f"the tolerance {TOLERANCE:g} (larger than the noise floor)"


def table(summary: dict, n: int) -> str:
    """The comparison as a markdown table plus the verdict lines."""
    lines = ["| mode | first loss | final loss | median step ms | peak MiB | optimizer state MiB/rank |",
             "|------|-----------:|-----------:|---------------:|---------:|-------------------------:|"]
    for mode, r in summary["modes"].items():
        lines.append(f"| {mode} | {r['first_loss']:.4f} | {r['final_loss']:.4f} | "
                     f"{r['median_step_ms']:.1f} | {r['peak_memory'] / 1024**2:.1f} | "
                     f"{r['state_bytes'] / 1024**2:.3f} |")
    d, f = summary["modes"]["ddp"], summary["modes"]["fsdp"]
    verdict = "within" if summary["within"] else "ABOVE"
    lines += ["",
              f"max |FSDP - DDP| loss over all steps: {summary['max_abs_diff']:.2e} "
              f"({verdict} {summary['limit']:g})",
              f"noise floor, max |DDP - DDP| loss of two DDP runs with the same seed: "
              f"{summary['noise_floor']:.2e}; FSDP judged against {_limit_name(summary)}",
              f"FSDP / DDP: optimizer state {f['state_bytes'] / d['state_bytes']:.3f}x (ideal 1/{n}), "
              f"peak memory {f['peak_memory'] / d['peak_memory']:.3f}x, "
              f"median step time {f['median_step_ms'] / d['median_step_ms']:.3f}x"]
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
    top.plot(steps, runs["ddp"]["loss"], color="tab:blue", lw=3.5, alpha=0.45, label="DDP")
    top.plot(steps, runs["fsdp"]["loss"], color="tab:red", lw=1.2, ls="--", marker="o",
             ms=2.5, label="FSDP")
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
    bottom.plot(steps, summary["diff"], color="tab:purple", marker=".", lw=1, label="FSDP − DDP")
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
    bottom.set_title(f"per step: max |FSDP − DDP| = {summary['max_abs_diff']:.1e}, "
                     f"max |DDP − DDP| = {summary['noise_floor']:.1e} ({note})", fontsize=9)
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
              f"max_norm {args.max_norm:g}; runs DDP, FSDP, then DDP again for the noise floor",
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
    title = (f"DDP vs FSDP, {lm.plural(n, 'rank')}: {runs['ddp']['params'] / 1e6:.2f}M-parameter byte GPT, "
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
