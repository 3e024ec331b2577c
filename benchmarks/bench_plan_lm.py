"""The memory planner against ``python -m mlx_fsdp.lora``: a whole fine-tuning run, per rank.

What a user plans and then runs: for each fine-tune type (``--kinds``),
mode (``--modes``: ``ddp`` is ``--no-fsdp``, ``fsdp`` the default,
``fully_shard`` and ``resharded`` add ``--fully-shard`` and
``--reshard-after-forward``) and optimizer, this runs ``mlx_fsdp.lora``'s own
``main`` in this process (mlx-lm's loading, LoRA layers, compiled trainer,
evaluation and saving, with the sharded checkpoints) on a random-weight
Llama (``mlx_fsdp.lm.tiny``: ``--layers`` blocks of ``--hidden``) and
reads the highest ``mx.get_peak_memory()`` of the run on any rank (the
peak is reset before each run). Beside it, the planner's answer for the
same run, as its command line gives it: ``python -m mlx_fsdp.plan_memory
MODEL --fine-tune-type ... --num-layers -1 --batch-size B --seq-len L
--compiled`` (mlx-lm's trainer compiles its step), with B the sequences
per rank (``--batch-size`` over N) and L the length mlx-lm pads a batch to
(the next multiple of 32 of its longest line, ``--words`` words and the
end token).

    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_plan_lm.py
    mpirun --allow-run-as-root --oversubscribe -n 3 python benchmarks/bench_plan_lm.py --batch-size 6
"""

import argparse
import contextlib
import gc
import io
import json
import math
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402

from mlx_fsdp.lm.tiny import write_data, write_model  # noqa: E402

MiB = 1024**2
MODES = {"ddp": ["--no-fsdp"], "fsdp": [], "fully_shard": ["--fully-shard"],
         "resharded": ["--fully-shard", "--reshard-after-forward"]}


def run_peak(flags, group) -> int:
    """The highest peak of one ``python -m mlx_fsdp.lora`` run over the ranks (bytes)."""
    from mlx_fsdp.lora import main

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    with contextlib.redirect_stdout(io.StringIO()):
        main(flags)
    peak = mx.array([mx.get_peak_memory()])
    return int(mx.distributed.all_gather(peak[None], group=group).max().item())


def planned(model: str, kind: str, mode: str, optimizer: str, batch: int, seq: int,
            n: int) -> int:
    """The planner's peak for the fullest rank, from its command line's JSON (bytes)."""
    from mlx_fsdp.plan_memory.__main__ import main

    planner_mode = "fully_shard" if mode in ("fully_shard", "resharded") else mode
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        argv = [model, "--fine-tune-type", kind, "--num-layers", "-1", "--batch-size",
                str(batch), "--seq-len", str(seq), "--mode", planner_mode, "--ranks", str(n),
                "--optimizer", optimizer, "--master-dtype", "none", "--compiled",
                "--json", out] + (["--reshard-after-forward"] if mode == "resharded" else [])
        with contextlib.redirect_stdout(io.StringIO()):
            main(argv)
        with open(out) as fh:
            return json.load(fh)["rows"][0]["fullest_rank"]["peak"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256, help="model width (a multiple of 16)")
    p.add_argument("--kinds", nargs="+", default=["lora", "full"], choices=("lora", "full"))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--optimizers", nargs="+", default=["adamw", "sgd"],
                   choices=("adam", "adamw", "sgd", "muon", "adafactor"))
    p.add_argument("--batch-size", type=int, default=4, help="mlx-lm's, over all ranks")
    p.add_argument("--words", type=int, default=40, help="words per line of the data")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    group = mx.distributed.init()
    n, rank = group.size(), group.rank()
    seq = 32 * math.ceil((args.words + 1) / 32)  # the words and the end token, padded
    # The runs' directories (checkpoints, adapters) are one path on every rank, as
    # the checkpoints require: rank 0's number names them.
    tag = int(mx.distributed.all_sum(mx.array(os.getpid() if rank == 0 else 0), group=group))
    runs = os.path.join(tempfile.gettempdir(), f"bench_plan_lm-{tag}")
    with tempfile.TemporaryDirectory() as tmp:
        model, data = os.path.join(tmp, "model"), os.path.join(tmp, "data")
        write_model(model, hidden_size=args.hidden, layers=args.layers, seed=0)
        write_data(data, train=4 * args.batch_size, valid=args.batch_size, test=0,
                   words_per_line=args.words)
        if rank == 0:
            print(f"python -m mlx_fsdp.lora at N={n}: Llama {args.layers} x {args.hidden}, "
                  f"float32, batch {args.batch_size} ({args.batch_size // n} per rank) x {seq} "
                  f"tokens, {args.iters} iterations; peak: max over ranks and the whole run")
            print("| fine-tune | mode | optimizer | peak predicted MiB | peak measured MiB | "
                  "predicted / measured |")
            print("|---|---|---|---:|---:|---:|", flush=True)
        ratios, rows = [], []
        for kind in args.kinds:
            for mode in args.modes:
                for optimizer in args.optimizers:
                    run = os.path.join(runs, f"{kind}-{mode}-{optimizer}")
                    got = run_peak(["--model", model, "--data", data, "--train",
                                    "--fine-tune-type", kind, "--num-layers", "-1",
                                    "--optimizer", optimizer, "--batch-size",
                                    str(args.batch_size), "--iters", str(args.iters),
                                    "--steps-per-eval", str(args.iters), "--val-batches", "1",
                                    "--adapter-path", run, *MODES[mode]], group)
                    want = planned(model, kind, mode, optimizer, args.batch_size // n, seq, n)
                    ratios.append(want / got)
                    rows.append({"kind": kind, "mode": mode, "optimizer": optimizer,
                                 "predicted": want, "measured": got})
                    if rank == 0:
                        print(f"| {kind} | {mode} | {optimizer} | {want / MiB:.2f} | "
                              f"{got / MiB:.2f} | {want / got:.3f} |", flush=True)
    mx.eval(mx.distributed.all_sum(mx.array(0), group=group))  # every rank is done with them
    if rank == 0:
        shutil.rmtree(runs, ignore_errors=True)
        print(f"predicted / measured: lowest {min(ratios):.3f} (below 1: measured above the "
              f"bound), highest {max(ratios):.3f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"config": vars(args), "n": n, "seq_len": seq, "rows": rows}, fh,
                          indent=1)


if __name__ == "__main__":
    main()
