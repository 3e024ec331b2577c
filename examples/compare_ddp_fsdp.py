"""Train the same model with DDP and with FSDP, in one launch, and compare.

Both runs start from the same seed and see the same global batches (each rank
its own slice). They run one after the other, so each mode's peak memory is its
own. The result goes to ``--out``:

* ``compare.json``: ``{"ddp": {"loss": [...], "step_ms": [...], "peak_memory": ...},
  "fsdp": {...}, "config": {...}}``;
* ``compare.png``: both loss curves, and their per-step difference below
  (needs matplotlib: ``pip install -e '.[plot]'``).

Rank 0 prints a table: final losses, the largest per-step difference, median
step time, peak memory and optimizer state per rank for each mode.

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

#: FSDP and DDP losses should agree to this at every step (float32).
TOLERANCE = 1e-3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="compare_out", help="output folder (default ./compare_out)")
    lm.add_training_args(p)
    p.set_defaults(steps=50)
    args = p.parse_args(argv)
    lm.check_args(p, args)
    return args


def summarize(runs: dict) -> dict:
    """Per-mode figures and the per-step difference of the two loss curves."""
    diff = [f - d for d, f in zip(runs["ddp"]["loss"], runs["fsdp"]["loss"])]
    rows = {}
    for mode, run in runs.items():
        # The first step includes building the plan and warming the caches.
        times = run["step_ms"][1:] or run["step_ms"]
        rows[mode] = {"final_loss": run["loss"][-1], "first_loss": run["loss"][0],
                      "median_step_ms": statistics.median(times),
                      "peak_memory": run["peak_memory"], "state_bytes": run["state_bytes"]}
    return {"diff": diff, "max_abs_diff": max(abs(d) for d in diff), "modes": rows}


def table(summary: dict, n: int) -> str:
    """The comparison as a markdown table plus the verdict lines."""
    lines = ["| mode | first loss | final loss | median step ms | peak MiB | optimizer state MiB/rank |",
             "|------|-----------:|-----------:|---------------:|---------:|-------------------------:|"]
    for mode, r in summary["modes"].items():
        lines.append(f"| {mode} | {r['first_loss']:.4f} | {r['final_loss']:.4f} | "
                     f"{r['median_step_ms']:.1f} | {r['peak_memory'] / 1024**2:.1f} | "
                     f"{r['state_bytes'] / 1024**2:.3f} |")
    d, f = summary["modes"]["ddp"], summary["modes"]["fsdp"]
    worst = summary["max_abs_diff"]
    lines += ["",
              f"max |FSDP - DDP| loss over all steps: {worst:.2e} "
              f"({'within' if worst <= TOLERANCE else 'ABOVE'} {TOLERANCE:g})",
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
    top.set_ylabel("training loss (nats / byte)")
    top.set_title(title, fontsize=10)
    agree = summary["max_abs_diff"] <= TOLERANCE
    top.legend(title=f"curves agree to {TOLERANCE:g}" if agree else f"curves differ by > {TOLERANCE:g}",
               title_fontsize=8)
    top.grid(alpha=0.3)

    diff = summary["diff"]
    bottom.axhline(0.0, color="black", lw=0.8)
    for bound in (TOLERANCE, -TOLERANCE):
        bottom.axhline(bound, color="tab:gray", lw=0.8, ls=":")
    bottom.plot(steps, diff, color="tab:purple", marker=".", lw=1)
    span = max(summary["max_abs_diff"] * 1.3, 1e-7)
    if span < TOLERANCE:
        # Zoom on the difference; say where the tolerance lies instead of drawing it off-scale.
        bottom.set_ylim(-span, span)
        note = f"tolerance ±{TOLERANCE:g} is off this scale"
    else:
        note = f"dotted: tolerance ±{TOLERANCE:g}"
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    bottom.set_ylabel("FSDP − DDP loss")
    bottom.set_xlabel("optimizer step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    if summary["max_abs_diff"] == 0:
        note = "identical losses at every step"
    bottom.set_title(f"per-step difference: max |Δ| = {summary['max_abs_diff']:.1e} ({note})",
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
        print(f"DDP vs FSDP on {n} rank(s): {args.steps} steps, global batch {args.batch_size} x "
              f"{args.seq_len} bytes, {args.optimizer}, {args.dtype}, max_norm {args.max_norm:g}",
              flush=True)
    runs = {mode: lm.train(mode, args, data, group,
                           checkpoint_dir=os.path.join(args.checkpoint_dir, mode))
            for mode in lm.MODES}
    if rank != 0:
        return
    summary = summarize(runs)
    config = {k: v for k, v in vars(args).items()}
    config.update(world_size=n, params=runs["ddp"]["params"], data_bytes=int(len(data)))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump({**runs, "config": config, "max_abs_diff": summary["max_abs_diff"]}, f, indent=1)
    title = (f"DDP vs FSDP, {n} rank(s): {runs['ddp']['params'] / 1e6:.2f}M-parameter byte GPT, "
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
