"""Train a small byte-level GPT with ``mlx_fsdp``: the sharded step, fully sharded, or DDP.

``--mode fsdp`` (the default) shards the optimizer state and the update;
``--mode fully_shard`` shards the parameters and gradients too
(``mlx_fsdp.fully_shard`` on every block, then on the model;
``--reshard-after-forward`` frees each block's gathered parameters after its
forward pass and gathers them again for its backward pass); ``--mode ddp`` is
the replicated baseline.

The default data is the ``.py`` source of Python's own standard library, so
nothing is downloaded; ``--data PATH`` takes a text file or a folder instead.
``--batch-size`` is the global batch: each rank trains on its own slice of
every batch, so the result does not depend on the number of ranks.

    mlx.launch -n 2 --backend ring -- python examples/train.py            # 2 local ranks
    python examples/train.py --steps 20                                   # one process
    MLX_MPI_LIBNAME=libmpi.so.40 mpirun --allow-run-as-root --oversubscribe \
        -x MLX_MPI_LIBNAME -n 4 python examples/train.py --mode ddp       # MPI, as root on Debian
    mlx.launch -n 2 --backend ring -- python examples/train.py --mode fully_shard \
        --reshard-after-forward                                           # parameters sharded too

(On Debian, MLX finds Open MPI only as ``libmpi.so.40``, which ``-x`` passes
to every rank; Open MPI refuses root without ``--allow-run-as-root`` and more
ranks than cores without ``--oversubscribe``. Drop what your system does not need.)

Rank 0 prints a line every ``--log-every`` steps (step, loss averaged over all
ranks, tokens/s, step time, peak memory, learning rate; with Muon both rates),
the path of every checkpoint it saves, and a summary at the end.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lm  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=lm.MODES, default="fsdp",
                   help="fsdp: sharded optimizer state and update; fully_shard: parameters and "
                   "gradients sharded too; ddp: the replicated baseline (default fsdp)")
    lm.add_training_args(p)
    args = p.parse_args(argv)
    lm.check_args(p, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    group = lm.init_distributed()
    data = lm.load_corpus(args.data, args.max_data_bytes)
    rank, n = group.rank(), group.size()
    if rank == 0:
        print(f"{args.mode}: {lm.plural(n, 'rank')}; {len(data) / 1e6:.1f} MB of text from "
              f"{args.data or 'the Python standard library'}; global batch {args.batch_size} x "
              f"{args.seq_len} bytes x {lm.plural(args.grad_accumulation_steps, 'micro-batch', 'es')}; "
              f"{lm.describe_rates(args)}; {args.dtype}", flush=True)
    run = lm.train(args.mode, args, data, group)
    if rank == 0 and run["loss"]:
        times = run["step_ms"][1:] or run["step_ms"]  # the first step includes set-up
        print(f"done: {run['params'] / 1e6:.3f}M parameters, steps {run['first_step'] + 1}-{args.steps}, "
              f"loss {run['loss'][0]:.4f} -> {run['loss'][-1]:.4f}, "
              f"median {statistics.median(times):.1f} ms/step, "
              f"{statistics.median(run['tokens_per_s'][1:] or run['tokens_per_s']):.0f} tok/s, "
              f"peak memory {run['peak_memory'] / 1024**2:.1f} MiB (max over ranks), "
              f"optimizer state {run['state_bytes'] / 1024**2:.3f} MiB per rank", flush=True)


if __name__ == "__main__":
    main()
