"""mlx-lm's trainer step: its own DDP against ``fsdp_step`` (mlx_fsdp.lm), on a small Llama.

Each mode runs ``mlx_lm.tuner.trainer.train`` itself, on the same model (a
random-weight Llama from ``mlx_fsdp.lm.tiny``, built in a temporary directory
on every rank, same seed), the same batches and AdamW:

* ``ddp``: a plain ``optim.AdamW``; mlx-lm's trainer all-reduces the
  gradients (``mlx.nn.average_gradients``), as ``mlx_lm.lora`` does;
* ``fsdp``: ``mlx_fsdp.lm.sharded_training(optim.AdamW(...))``:
  ``fsdp_step``, with the trainer's all-reduce turned off;
* ``fsdp-double``: ``fsdp_step`` handed to the trainer as it is, so every
  step all-reduces and then reduce-scatters (what the issue measured).

Step time: the trainer's own per-iteration time (its ``iterations_per_second``
report with ``steps_per_report=1``: the compiled step and ``mx.eval``, not
batch making or reporting), median (and minimum, which a neighbour's load
disturbs least) over ``--steps`` iterations after ``--warmup`` untimed ones,
max over ranks. The modes take turns in ABBA order
(``ddp fsdp fsdp ddp ...``, ``--rounds`` times each), each turn a fresh model
and ``train`` call, so a neighbour's load hits all of them alike. Peak memory
(``mx.get_peak_memory``, reset before each turn, max over ranks) counts
everything: parameters, gradients, optimizer state, activations, buffers.
Optimizer state: bytes of the arrays in ``optimizer.state`` with at least one
dimension, per rank. The losses of every mode's first turn are compared with
``ddp``'s as a check that all modes trained alike.

    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_lm.py
    mlx.launch -n 2 --backend ring -- python benchmarks/bench_lm.py --fine-tune-type lora
    python benchmarks/bench_lm.py --steps 3 --warmup 1          # one process
"""

import argparse
import contextlib
import gc
import io
import os
import statistics
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import mlx_fsdp  # noqa: E402
from mlx_fsdp.lm import sharded_training  # noqa: E402
from mlx_fsdp.lm.tiny import write_data, write_model  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import publish  # noqa: E402

MODES = ("ddp", "fsdp", "fsdp-double")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--fine-tune-type", choices=["full", "lora"], default="full")
    p.add_argument("--batch-size", type=int, default=8, help="global batch (default 8)")
    p.add_argument("--steps", type=int, default=10, help="timed iterations per turn (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per turn (default 2)")
    p.add_argument("--rounds", type=int, default=1,
                   help="ABBA rounds: each mode runs 2 * rounds turns (default 1)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    p.add_argument("--markdown", help="also write the table here")
    p.add_argument("--json", help="also write the numbers here")
    return p.parse_args(argv)


class _Reports:
    def __init__(self):
        self.seconds, self.losses = [], []

    def on_train_loss_report(self, info):
        self.seconds.append(1.0 / info["iterations_per_second"])
        self.losses.append(info["train_loss"])

    def on_val_loss_report(self, info):
        pass


def _model(path, args):
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    mx.random.seed(0)
    model, tokenizer = load(path)
    model.freeze()
    if args.fine_tune_type == "lora":
        linear_to_lora_layers(model, args.layers, {"rank": 8, "dropout": 0.0, "scale": 20.0})
    else:
        model.unfreeze()
    return model, tokenizer


def _state_bytes(optimizer) -> int:
    return sum(v.nbytes for _, v in tree_flatten(optimizer.state) if v.ndim > 0)


def turn(mode: str, path: str, data, args, scratch: str) -> dict:
    """One fresh model trained by mlx-lm's ``train`` in ``mode``; its times, peak, state, losses."""
    from mlx_lm.tuner import trainer

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    model, _ = _model(path, args)
    np.random.seed(0)
    reports = _Reports()
    targs = trainer.TrainingArgs(
        batch_size=args.batch_size, iters=args.warmup + args.steps, steps_per_report=1,
        steps_per_eval=10**9, steps_per_save=10**9,
        adapter_file=os.path.join(scratch, "adapters.safetensors"))
    adamw = optim.AdamW(learning_rate=1e-4)
    run = dict(model=model, train_dataset=data, args=targs, training_callback=reports)
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer's progress display
        if mode == "fsdp":
            with sharded_training(adamw) as opt:
                trainer.train(optimizer=opt, **run)
        else:
            opt = mlx_fsdp.fsdp_step(adamw) if mode == "fsdp-double" else adamw
            trainer.train(optimizer=opt, **run)
    return {"seconds": reports.seconds[args.warmup:], "losses": reports.losses,
            "peak": mx.get_peak_memory(), "state": _state_bytes(opt)}


def _max_over_ranks(world, values):
    return mx.distributed.all_gather(mx.array([values], dtype=mx.float32), group=world).max(axis=0).tolist()


def main(argv=None):
    from mlx_lm import load
    from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset

    args = parse_args(argv)
    modes = args.modes.split(",")
    world = mx.distributed.init()
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "model")
        write_model(path, model_type="llama", hidden_size=args.hidden, layers=args.layers)
        write_data(os.path.join(scratch, "data"), train=max(64, 4 * args.batch_size), valid=0,
                   test=0, words_per_line=28)
        _, tokenizer = load(path)
        train_set, _, _ = load_local_dataset(Path(scratch) / "data", tokenizer,
                                             types.SimpleNamespace())
        data = CacheDataset(train_set)
        order = (modes + modes[::-1]) * args.rounds
        results = {m: [] for m in modes}
        for mode in order:
            results[mode].append(turn(mode, path, data, args, scratch))
        model, _ = _model(path, args)
        trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))

    rows, record = [], {"modes": {}, "config": vars(args), "world_size": world.size(),
                        "trainable_parameters": trainable}
    for mode in modes:
        seconds = [s for r in results[mode] for s in r["seconds"]]
        step_ms, min_ms, peak, state = _max_over_ranks(world, [
            1000 * statistics.median(seconds), 1000 * min(seconds),
            max(r["peak"] for r in results[mode]), results[mode][0]["state"]])
        losses = results[mode][0]["losses"]
        diff = max(abs(a - b) for a, b in zip(losses, results[modes[0]][0]["losses"]))
        turns = [1000 * statistics.median(r["seconds"]) for r in results[mode]]
        record["modes"][mode] = {"step_ms": step_ms, "min_step_ms": min_ms,
                                 "peak_bytes": peak, "state_bytes": state,
                                 "rank_turn_median_ms": turns,
                                 "losses": losses, "max_loss_diff_vs_first": diff}
    base = record["modes"][modes[0]]
    for mode in modes:
        r = record["modes"][mode]
        rows.append(f"| {mode} | {r['step_ms']:.1f} | {r['step_ms'] / base['step_ms']:.3f} | "
                    f"{r['min_step_ms']:.1f} | {r['min_step_ms'] / base['min_step_ms']:.3f} | "
                    f"{r['peak_bytes'] / 2**20:.1f} | {r['peak_bytes'] / base['peak_bytes']:.3f} | "
                    f"{r['state_bytes'] / 2**20:.2f} | {r['state_bytes'] / base['state_bytes']:.3f} | "
                    f"{r['max_loss_diff_vs_first']:.1e} |")
    header = (f"mlx-lm trainer, Llama {args.hidden}x{args.layers} ({trainable / 1e6:.2f}M trainable, "
              f"{args.fine_tune_type}), AdamW, N={world.size()}, global batch {args.batch_size}, "
              f"{len(results[modes[0]])} x {args.steps} timed steps per mode")
    table = "\n".join([
        f"| mode | median step ms | time vs {modes[0]} | min step ms | min vs {modes[0]} | "
        f"peak MiB | peak vs {modes[0]} | "
        f"optimizer state MiB/rank | state vs {modes[0]} | max loss diff vs {modes[0]} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows])
    if world.rank() == 0:
        publish(header, table, args.markdown, args.json, record)


if __name__ == "__main__":
    main()
