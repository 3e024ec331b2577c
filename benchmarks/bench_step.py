"""Benchmark one training step of ``mlx_fsdp.ddp_step``, ``fsdp_step`` and ``fully_shard``.

Two models: an MLP (``--model mlp``, the default) and the example GPT of
``examples/lm.py`` (``--model gpt``; ``--model mlp gpt`` runs both). The
sweep covers model widths (``--hidden`` for the MLP, ``--dims`` for the GPT),
bucket sizes (``--communication-size``) and parameter dtypes (``--dtype``);
``--sweep quick`` (the default) and ``--sweep full`` name preset lists, and
each flag overrides its list. ``--layers`` sets both models' depth, ``--heads``
and ``--seq-len`` the GPT's attention heads and sequence length, ``--batch``
the rows per rank. Rank 0 prints one markdown row per point; ``--markdown
PATH`` and ``--json PATH`` also write them to files.

``--modes`` adds rows to the two that always run (``ddp``, and ``fsdp``:
the sharded step, optimizer state and gradients sharded, whole parameters on
every rank), all timed side by side in the same ABBA blocks:

* ``fully_shard``: parameters sharded too (``mlx_fsdp.fully_shard``, then
  ``fsdp_step``), one row per ``--wrap``: ``root`` (the default: the whole
  model wrapped once, ``fully_shard(model)``), ``blocks`` (each of the MLP's
  ``layers`` or the GPT's ``blocks`` wrapped, then the root) and ``reshard``
  (the same with ``reshard_after_forward=True`` on every block);
* ``ddp_checkpoint``: ``ddp_step`` with each layer or block recomputed in
  the backward pass (``mlx.nn.utils.checkpoint``), the replicated reference
  for resharding, which recomputes each block too.

With more than ``ddp`` and ``fsdp`` a second table follows the first, one
row per mode: step time over the sharded step's (``fsdp``) and over DDP's,
peak over DDP's, and the bytes of parameters each rank holds.

It runs on the device MLX defaults to (the GPU where MLX has one) and labels
every row with it; ``--cpu`` forces the CPU.

Every mode trains its own copy of the same model (same seed, hence the same
initial weights on every rank and in every mode) with AdamW on the same
per-rank random batch (each rank has different data; cross-entropy loss, in
float32). Each point of the sweep measures, per rank:

* **Step time**: forward and backward (``nn.value_and_grad``), ``opt.update``
  and one ``mx.eval`` of the loss, the parameters and the optimizer state,
  timed with ``time.perf_counter`` between two ``mx.synchronize()`` calls. The
  median is over ``--steps`` timed steps that follow ``--warmup`` untimed
  ones. All models live in one timing phase and take turns in blocks of
  ``--block`` steps, in ABBA order (D F F D D F ...; with more modes the
  list, then the list reversed), so that machine noise, thermal drift and a
  neighbour's load hit every mode alike; the first step of each block is not
  timed. Steps are not interleaved one by one: each mode's step then runs
  right after another mode's, on memory the other just freed, and that
  slowed DDP more than FSDP. Measured on the 2-core
  development machine (ring N=2, 4.2M MLP, 60 steps), per-step alternation
  read FSDP/DDP as 0.900 and 0.920, while each mode alone in a process of
  its own took DDP 262-265 ms and FSDP 258-272 ms per step.
* **Update hold**: how long ``opt.update`` keeps the caller, from the call
  to its return, in the same timed steps (median). A step that only builds
  the lazy graph returns at once and leaves the work to the caller's
  ``mx.eval``; one that evaluates inside ``update`` holds the caller until
  its collectives are done.
* **Peak memory**: ``mx.get_peak_memory()`` is process-wide, so it is measured
  in separate isolation phases, one per mode, *before* the timing phase.
  Each phase starts from a clean process state (``gc.collect()``,
  ``mx.clear_cache()``), builds that mode's model and optimizer, resets the
  peak (``mx.reset_peak_memory()``: building a fully sharded model briefly
  holds one wrapped module's full parameters, which is not the step's
  memory), runs ``max(warmup, 1) + 2`` steps (the AdamW state exists
  from step 1, so the peak is reached by step 2), records the peak and then
  drops the model, optimizer and gradients. Only the shared input batch
  (identical in every phase) is alive besides the measured mode, so the
  difference between two peaks is due to the modes alone. The peak counts
  everything MLX allocates: parameters, gradients, optimizer state,
  activations, communication buffers and temporaries.
* **Gradients-only peak**: the same isolation for the forward and backward
  pass alone (the model and its gradients, no optimizer). Every DDP and
  FSDP step's peak holds at least this much; what they add over it is their
  optimizer state and communication buffers (a fully sharded step can stay
  below it: it never holds all parameters or gradients whole). ``peak saved / state dropped`` is
  ``(DDP peak - FSDP peak) / (DDP state - FSDP state)``: the share of the
  optimizer state FSDP no longer holds that shows as a lower peak (1 when
  its buffers cost nothing, above 1 when they cost less than DDP's).
* **Optimizer-state bytes**: the sum of ``nbytes`` of all arrays in
  ``opt.state`` with at least one dimension (``mlx.utils.tree_flatten``).
  Scalars (``step``, ``learning_rate``, ``grad_norm``) are skipped: they are a
  few bytes and the same in both modes. The ideal FSDP/DDP ratio is ``1/N``;
  FSDP pads every array to a multiple of ``N`` so it can be a little above.

Numbers are gathered from all ranks; the table reports the maximum over ranks
(the slowest / fullest rank bounds the step). Only rank 0 prints: the table
on stdout and, on stderr, progress lines (steps done and steps per second,
every few seconds) and one summary line per point. The header line names the
device and the reduce-scatter method FSDP uses on this backend (ring and MPI
have no ``sum_scatter``, so it is the two-rank ``exchange`` or an ``all_sum``
followed by a slice there).

After the timing phase the largest parameter difference between FSDP's and
DDP's models goes to the JSON (``max_param_diff``; each further mode's
against DDP's as ``max_param_diff`` in its record, fully sharded models
gathered whole with ``mlx_fsdp.full_parameters``) as a sanity check: all
took the same steps on the same data. Without clipping (``--max-norm 0``) it is exactly 0. With clipping the
float32 global norm is summed in a different order (full arrays vs. shards
then ``all_sum``), so the clip scales differ in the last digits; AdamW turns
such tiny differences into differences of up to a few ``lr`` for elements
whose gradient is near zero, so values of order ``lr * steps`` are expected.

Run it from the repository root, no installation needed::

    python benchmarks/bench_step.py --steps 3 --warmup 1          # one process
    mlx.launch -n 2 --backend ring -- python benchmarks/bench_step.py
    mlx.launch -n 2 --backend ring -- python benchmarks/bench_step.py --sweep full \\
        --markdown step.md --json step.json
    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_step.py --model gpt \\
        --dims 256 --layers 4 --heads 4 --seq-len 32 --batch 4 --communication-size 32MiB
    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_step.py --hidden 2048 \\
        --batch 8 --dtype float32 --communication-size default \\
        --modes fully_shard ddp_checkpoint --wrap root blocks reshard
    MLX_MPI_LIBNAME=libmpi.so.40 mpirun --allow-run-as-root --oversubscribe \\
        -x MLX_MPI_LIBNAME -n 4 python benchmarks/bench_step.py      # MPI, as root on Debian
"""

import argparse
import gc
import functools
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import mlx_fsdp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import lm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MLP, Progress, publish  # noqa: E402

MB = 1024**2
#: The modes that always run: every ratio is to one of them.
MODES = ("ddp", "fsdp")
#: What ``--modes`` can add.
EXTRA_MODES = ("fully_shard", "ddp_checkpoint")
#: The rows ``--wrap`` gives ``fully_shard``: the whole model once, each block then the
#: root, the same with ``reshard_after_forward=True`` on every block.
WRAPS = {"root": "fully_shard", "blocks": "fully_shard_blocks", "reshard": "fully_shard_reshard"}
#: How the second table names each mode.
LABELS = {"ddp": "DDP", "fsdp": "FSDP (sharded step)", "fully_shard": "fully_shard, root",
          "fully_shard_blocks": "fully_shard, per block + root",
          "fully_shard_reshard": "fully_shard, per block (reshard) + root",
          "ddp_checkpoint": "DDP + checkpoint per block"}
MODELS = ("mlp", "gpt")
#: Where each model keeps its layers or blocks (what ``--wrap blocks`` and ``ddp_checkpoint`` wrap).
BLOCKS = {"mlp": "layers", "gpt": "blocks"}
#: Rows per rank when ``--batch`` is not given: the MLP's, and the GPT's (of ``--seq-len`` tokens).
DEFAULT_BATCH = {"mlp": 32, "gpt": 4}

#: The sweeps ``--sweep`` names: model widths (MLP ``hidden``, GPT ``dims``), bucket sizes and dtypes.
SWEEPS = {
    "quick": {"hidden": [512], "dims": [256], "communication_size": [1 * MB, 32 * MB],
              "dtype": ["float32", "bfloat16"]},
    "full": {"hidden": [512, 1024, 2048], "dims": [256, 512],
             "communication_size": [1 * MB, 16 * MB, 32 * MB], "dtype": ["float32", "bfloat16"]},
}


def parse_args(argv=None):
    """Parse the command line.

    Args:
        argv (list, optional): Arguments; ``None`` means ``sys.argv[1:]``.

    Returns:
        argparse.Namespace: The options; ``model``, ``hidden``, ``dims``,
        ``communication_size`` and ``dtype`` are lists (the sweep).
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=MODELS, nargs="+", default=["mlp"],
                   help="mlp: Linear layers of --hidden width; gpt: the example byte GPT of "
                   "--dims width (default mlp)")
    p.add_argument("--modes", choices=MODES + EXTRA_MODES, nargs="+", default=list(MODES),
                   help="modes to time side by side; ddp and fsdp always run (the ratios are to "
                   "them). fully_shard: parameters sharded too, one row per --wrap; "
                   "ddp_checkpoint: ddp_step with every layer/block recomputed in the backward "
                   "pass (mlx.nn.utils.checkpoint) (default ddp fsdp)")
    p.add_argument("--wrap", choices=sorted(WRAPS), nargs="+", default=None,
                   help="with --modes fully_shard, how to wrap: root (the whole model once), "
                   "blocks (each MLP layer / GPT block, then the root), reshard (the same with "
                   "reshard_after_forward=True per block); one row each (default root)")
    p.add_argument("--sweep", choices=sorted(SWEEPS), default="quick",
                   help="preset lists of widths, bucket sizes and dtypes (default quick: "
                   "MLP width 512, GPT dims 256; 1 and 32 MiB; float32 and bfloat16)")
    p.add_argument("--hidden", type=int, nargs="+", help="MLP widths (overrides --sweep)")
    p.add_argument("--dims", type=int, nargs="+", help="GPT widths (overrides --sweep)")
    p.add_argument("--layers", type=int, default=4,
                   help="MLP Linear layers, GPT transformer blocks (default 4)")
    p.add_argument("--heads", type=int, default=4, help="GPT attention heads (default 4)")
    p.add_argument("--seq-len", type=int, default=32, help="GPT tokens per row (default 32)")
    p.add_argument("--batch", type=int, default=None,
                   help="rows per rank (default 32 for the MLP, 4 for the GPT)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per mode (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode (default 2)")
    p.add_argument("--block", type=int, default=5,
                   help="timed steps per mode before the other mode takes its turn (default 5)")
    p.add_argument(
        "--communication-size",
        type=_size,
        nargs="+",
        help="bucket sizes for both modes, e.g. 256KiB 16MiB 32MiB, or 'default' for each "
        "mode's own default (overrides --sweep)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), nargs="+",
                   help="parameter dtypes (overrides --sweep)")
    p.add_argument(
        "--max-norm", type=float, default=1.0, help="gradient clipping norm; <= 0 disables"
    )
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="model seed (same on all ranks)")
    p.add_argument("--cpu", action="store_true",
                   help="run on the CPU even where MLX defaults to a GPU")
    p.add_argument("--memory-limit", type=lm.parse_size, default=None,
                   help="mx.set_memory_limit for the whole run, e.g. 1MiB: evaluation waits "
                   "while more is allocated, so buffers are allocated no earlier than the "
                   "work that fills them (slower; default: MLX's own limit)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as markdown")
    args = p.parse_args(argv)
    if args.wrap is not None and "fully_shard" not in args.modes:
        p.error(f"--wrap {' '.join(args.wrap)} wraps the fully_shard rows; add fully_shard to "
                "--modes, or drop --wrap.")
    args.wrap = args.wrap or ["root"]
    for key, values in SWEEPS[args.sweep].items():
        if getattr(args, key) is None:
            setattr(args, key, values)
    if (min(args.hidden + args.dims) < 1 or args.layers < 1 or args.heads < 1 or args.seq_len < 1
            or (args.batch is not None and args.batch < 1) or args.steps < 1 or args.block < 1
            or args.warmup < 0):
        p.error("--hidden, --dims, --layers, --heads, --seq-len, --batch, --steps, --block "
                "must be >= 1 and --warmup >= 0")
    if "gpt" in args.model:
        bad = [d for d in args.dims if d % args.heads]
        if bad:
            p.error(f"--dims {' '.join(map(str, bad))} must divide by --heads={args.heads}; "
                    "give widths that are multiples of the head count.")
    return args


def configs(args):
    """One namespace per point of the sweep.

    Each has a scalar ``model``, ``width`` (the MLP's ``hidden`` or the GPT's
    ``dims``), ``batch``, ``communication_size`` and ``dtype``.
    """
    out = []
    for model in args.model:
        for width in (args.hidden if model == "mlp" else args.dims):
            for dtype in args.dtype:
                for size in args.communication_size:
                    cfg = argparse.Namespace(**vars(args))
                    cfg.model, cfg.width, cfg.dtype, cfg.communication_size = model, width, dtype, size
                    cfg.batch = args.batch or DEFAULT_BATCH[model]
                    out.append(cfg)
    return out


def make_batch(args, rank: int):
    """A random batch that differs per rank and is reproducible.

    Args:
        args (argparse.Namespace): One point of the sweep.
        rank (int): This process's rank.

    Returns:
        tuple: ``(x, y)``. MLP: inputs of shape ``(batch, width)`` in
        ``--dtype`` and class targets of shape ``(batch,)``. GPT: byte tokens
        and next-byte targets, both of shape ``(batch, seq_len)``.
    """
    kx, ky = mx.random.split(mx.random.key(10_000 + rank))
    if args.model == "gpt":
        x = mx.random.randint(0, lm.VOCAB, (args.batch, args.seq_len), key=kx)
        y = mx.random.randint(0, lm.VOCAB, (args.batch, args.seq_len), key=ky)
    else:
        x = mx.random.normal((args.batch, args.width), key=kx).astype(getattr(mx, args.dtype))
        y = mx.random.randint(0, args.width, (args.batch,), key=ky)
    mx.eval(x, y)
    return x, y


def run_modes(args) -> list:
    """The modes one point runs, in timing order: ``ddp``, ``fsdp``, then ``--modes``' others
    (``fully_shard`` as one mode per ``--wrap``)."""
    out = list(MODES)
    for m in args.modes:
        for mode in ([WRAPS[w] for w in args.wrap] if m == "fully_shard" else [m]):
            if mode not in out:
                out.append(mode)
    return out


def make_model(args, evaluate: bool = True) -> nn.Module:
    """The point's model, from ``--seed``, in its dtype.

    With ``evaluate=False`` the parameters stay lazy, so that ``fully_shard``
    materializes one wrapped module's full parameters at a time (the values
    are the same either way: MLX draws the initializers' keys when the
    model is built).
    """
    mx.random.seed(args.seed)
    if args.model == "gpt":
        model = lm.ByteGPT(args.width, args.layers, args.heads, args.seq_len)
    else:
        model = MLP(args.width, args.layers)
    model.set_dtype(getattr(mx, args.dtype))
    if evaluate:
        mx.eval(model.parameters())
    return model


def shard_model(model: nn.Module, mode: str, args, optimizer) -> nn.Module:
    """``model`` wrapped with ``mlx_fsdp.fully_shard`` as ``mode`` says.

    ``fully_shard``: the whole model once. ``fully_shard_blocks`` and
    ``fully_shard_reshard``: each layer or block (``BLOCKS``), the latter with
    ``reshard_after_forward=True``, then the root for what is left (the GPT's
    embeddings, norm and head; nothing for the MLP, whose root then stays
    unwrapped). ``placement=optimizer`` keeps whole the arrays of optimizers
    that need them, as ``examples/lm.py``'s ``fully_shard_model`` does.
    """
    shard = functools.partial(mlx_fsdp.fully_shard, communication_size=args.communication_size,
                              placement=optimizer)
    if mode != "fully_shard":
        blocks = getattr(model, BLOCKS[args.model])
        for i, block in enumerate(blocks):
            blocks[i] = shard(block, reshard_after_forward=mode == "fully_shard_reshard")
    return shard(model)


def checkpoint_blocks(model: nn.Module, args) -> nn.Module:
    """``model`` with every layer or block recomputed in the backward pass.

    Each block's class is swapped for a subclass whose call goes through
    ``mlx.nn.utils.checkpoint``, so the parameter paths stay those of the
    plain model and other models of the same classes are untouched.
    """
    for block in getattr(model, BLOCKS[args.model]):
        cls = type(block)
        block.__class__ = _checkpointed(cls)
    return model


@functools.lru_cache(maxsize=None)
def _checkpointed(cls):
    def __call__(self, *args, **kwargs):
        return nn.utils.checkpoint(self, functools.partial(cls.__call__, self))(*args, **kwargs)

    return type(f"Checkpointed{cls.__name__}", (cls,), {"__call__": __call__})


def build(mode: str, args, progress=None):
    """Create a fresh model (from ``--seed``) and its distributed optimizer.

    Args:
        mode (str): One of :func:`run_modes`: ``"ddp"``, ``"fsdp"``,
            ``"fully_shard"``, ``"fully_shard_blocks"``,
            ``"fully_shard_reshard"`` or ``"ddp_checkpoint"``.
        args (argparse.Namespace): One point of the sweep.
        progress (Progress, optional): Advanced after every step. Default: ``None``.

    Returns:
        tuple: ``(model, opt, step_fn)`` where ``step_fn(x, y)`` runs one full,
        evaluated training step and returns how many seconds ``opt.update``
        held the caller.
    """
    sharded = mode.startswith("fully_shard")
    model = make_model(args, evaluate=not sharded)
    wrap = mlx_fsdp.ddp_step if mode.startswith("ddp") else mlx_fsdp.fsdp_step
    opt = wrap(
        optim.AdamW(learning_rate=args.lr),
        max_norm=args.max_norm if args.max_norm > 0 else None,
        communication_size=args.communication_size,
    )
    if sharded:
        model = shard_model(model, mode, args, opt.optimizer)
        mx.eval(model.parameters())
    elif mode == "ddp_checkpoint":
        model = checkpoint_blocks(model, args)
    loss_and_grad = nn.value_and_grad(model, lm.loss_fn)

    def step_fn(x, y):
        loss, grads = loss_and_grad(model, x, y)
        called = time.perf_counter()
        opt.update(model, grads)
        held = time.perf_counter() - called
        mx.eval(loss, model.parameters(), opt.state)
        if progress is not None:
            progress.advance()
        return held

    return model, opt, step_fn


def timed(step_fn, x, y):
    """Run one step; return its wall time and ``opt.update``'s hold, in milliseconds."""
    mx.synchronize()
    t0 = time.perf_counter()
    held = step_fn(x, y)
    mx.synchronize()
    return (time.perf_counter() - t0) * 1e3, held * 1e3


def clean_slate():
    """Free everything unreferenced and reset the peak-memory counter."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()


def memory_steps(args) -> int:
    """Steps each mode's memory phase runs: the AdamW state exists from step 1, the peak by step 2."""
    return max(args.warmup, 1) + 2


def total_steps(args) -> int:
    """Steps one point runs: the gradients-only phase, then per mode memory, warm-up, timed and block-opening steps."""
    per_mode = memory_steps(args) + args.warmup + args.steps + math.ceil(args.steps / args.block)
    return memory_steps(args) + len(run_modes(args)) * per_mode


def grads_phase(args, x, y, progress=None) -> int:
    """The peak, in bytes, of the forward and backward pass alone, isolated as :func:`memory_phase`."""
    clean_slate()
    model = make_model(args)
    loss_and_grad = nn.value_and_grad(model, lm.loss_fn)
    for _ in range(memory_steps(args)):
        mx.eval(loss_and_grad(model, x, y))
        if progress is not None:
            progress.advance()
    peak = mx.get_peak_memory()
    del model, loss_and_grad
    clean_slate()
    return peak


def memory_phase(mode: str, args, x, y, progress=None) -> dict:
    """Measure one mode's peak memory with no other model alive.

    Args:
        mode (str): One of :func:`run_modes`.
        args (argparse.Namespace): One point of the sweep.
        x (mlx.core.array): This rank's inputs.
        y (mlx.core.array): This rank's targets.
        progress (Progress, optional): Advanced after every step. Default: ``None``.

    Returns:
        dict: ``peak_bytes``, ``state_bytes``, ``param_bytes`` (what this
        rank holds of the parameters), ``num_params`` (elements this rank
        holds) and the (non-interleaved) step times in ms of this phase as
        ``isolated_step_ms``.
    """
    clean_slate()
    model, opt, step_fn = build(mode, args, progress)
    gc.collect()
    mx.reset_peak_memory()  # the steps' peak, not the construction's
    times = [timed(step_fn, x, y)[0] for _ in range(memory_steps(args))]
    out = {
        "peak_bytes": mx.get_peak_memory(),
        "state_bytes": lm.state_bytes(opt),
        "param_bytes": sum(a.nbytes for _, a in tree_flatten(model.parameters())),
        "num_params": lm.num_params(model),
        "isolated_step_ms": times,
    }
    del model, opt, step_fn
    clean_slate()
    return out


def timing_phase(args, x, y, progress=None):
    """Time every mode's steps in alternating blocks (ABBA order: D F F D D F ...,
    with more modes the list, then the list reversed, and so on).

    Args:
        args (argparse.Namespace): One point of the sweep.
        x (mlx.core.array): This rank's inputs.
        y (mlx.core.array): This rank's targets.
        progress (Progress, optional): Advanced after every step. Default: ``None``.

    Returns:
        tuple: ``(times, holds, diffs)`` with ``times[mode]`` the timed step
        durations and ``holds[mode]`` how long ``opt.update`` held the caller
        in those steps, in ms, and ``diffs[mode]`` the largest absolute
        difference between that mode's parameters and DDP's at the end.
    """
    modes = run_modes(args)
    built = {m: build(m, args, progress) for m in modes}
    for m in modes:
        for _ in range(args.warmup):
            built[m][2](x, y)
    times = {m: [] for m in modes}
    holds = {m: [] for m in modes}
    i = 0
    while any(len(t) < args.steps for t in times.values()):
        for m in (modes if i % 2 == 0 else modes[::-1]):
            built[m][2](x, y)  # the block's first step runs after another mode: untimed
            for _ in range(min(args.block, args.steps - len(times[m]))):
                ms, held = timed(built[m][2], x, y)
                times[m].append(ms)
                holds[m].append(held)
        i += 1
    ddp = dict(tree_flatten(built["ddp"][0].parameters()))
    diffs = {}
    for m in modes[1:]:  # every rank gathers the fully sharded ones, in this order
        whole = tree_flatten(mlx_fsdp.full_parameters(built[m][0]))
        diffs[m] = max(mx.max(mx.abs(a.astype(mx.float32) - ddp[p].astype(mx.float32))).item()
                       for p, a in whole)
    return times, holds, diffs


def gather(group, values):
    """All-gather a list of floats (as float32) and return one row per rank."""
    if group.size() == 1:
        return [list(values)]
    rows = mx.distributed.all_gather(mx.array([values], dtype=mx.float32), group=group)
    return rows.tolist()


def device_label() -> str:
    """The device the steps run on, as MLX names its type: ``cpu`` or ``gpu``."""
    return mx.default_device().type.name


def describe(cfg) -> str:
    """The model of one point, for the table: ``MLP 4x512, batch 32`` or ``GPT 4x256, ...``."""
    if cfg.model == "gpt":
        return f"GPT {cfg.layers}x{cfg.width}, {cfg.heads} heads, batch {cfg.batch}x{cfg.seq_len}"
    return f"MLP {cfg.layers}x{cfg.width}, batch {cfg.batch}"


#: Per mode, the figures gathered from every rank (the table shows the maximum over ranks).
COLUMNS = ("step_ms_median", "update_ms_median", "peak_mb", "state_mb", "params_mb")


def run_config(cfg, group, x, y, progress=None) -> dict:
    """Measure one point of the sweep on every rank; rank 0 gets the full record.

    Returns:
        dict: Per mode ``step_ms_median``, ``update_ms_median`` (how long
        ``opt.update`` held the caller), ``peak_mb``, ``state_mb``,
        ``params_mb`` (what a rank holds of the parameters; max over ranks)
        and per-rank rows; for every mode but DDP, ``max_param_diff`` (to
        DDP's parameters) and ``vs`` (step time over the sharded step's and
        over DDP's, peak over DDP's); ``grads_peak_mb`` (the forward and
        backward pass alone, max over ranks), plus ``ratios`` (FSDP over
        DDP) and ``max_param_diff`` (FSDP's to DDP's).
    """
    modes = run_modes(cfg)
    grads_peak = grads_phase(cfg, x, y, progress)
    mem = {m: memory_phase(m, cfg, x, y, progress) for m in modes}
    times, holds, diffs = timing_phase(cfg, x, y, progress)
    local = []
    for m in modes:
        local += [statistics.median(times[m]), statistics.median(holds[m]),
                  mem[m]["peak_bytes"] / MB, mem[m]["state_bytes"] / MB, mem[m]["param_bytes"] / MB]
    rows = gather(group, local + [grads_peak / MB])  # the mode columns, then the grads-only peak
    worst = [max(r[i] for r in rows) for i in range(len(local) + 1)]  # max over ranks, per column
    grads_mb = worst[-1]
    k = len(COLUMNS)
    res = {"device": device_label(), "model": cfg.model, "width": cfg.width, "layers": cfg.layers,
           "batch": cfg.batch, "dtype": cfg.dtype, "communication_size": cfg.communication_size,
           "num_params": mem["ddp"]["num_params"], "max_param_diff": diffs["fsdp"],
           "grads_peak_mb": grads_mb, "modes": modes}
    if cfg.model == "gpt":
        res.update(dims=cfg.width, heads=cfg.heads, seq_len=cfg.seq_len)
    else:
        res.update(hidden=cfg.width)
    for j, m in enumerate(modes):
        res[m] = {
            **dict(zip(COLUMNS, worst[k * j : k * j + k])),
            "state_bytes_per_rank": mem[m]["state_bytes"],
            "per_rank": [dict(zip(COLUMNS, r[k * j : k * j + k])) for r in rows],
            "rank0_step_ms": times[m],
            "rank0_update_ms": holds[m],
        }
    d, f = res["ddp"], res["fsdp"]
    for m in modes[1:]:
        r = res[m]
        r["max_param_diff"] = diffs[m]
        r["vs"] = {"time_vs_fsdp": r["step_ms_median"] / f["step_ms_median"],
                   "time_vs_ddp": r["step_ms_median"] / d["step_ms_median"],
                   "peak_vs_ddp": r["peak_mb"] / d["peak_mb"]}
    res["ratios"] = {
        "time": f["step_ms_median"] / d["step_ms_median"],
        "update": f["update_ms_median"] / d["update_ms_median"],
        "peak_memory": f["peak_mb"] / d["peak_mb"],
        "state_bytes": f["state_bytes_per_rank"] / d["state_bytes_per_rank"],
        # None where FSDP drops no state (one process).
        "peak_saved_per_state_dropped": ((d["peak_mb"] - f["peak_mb"]) / (d["state_mb"] - f["state_mb"])
                                         if d["state_mb"] > f["state_mb"] else None),
    }
    return res


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def _size(text: str):
    # None: each wrapper picks its own default (fsdp_step's depends on the device).
    return None if text == "default" else lm.parse_size(text)


def _bucket(size) -> str:
    if size is None:
        ddp, fsdp = (wrap(optim.SGD(0.0)).communication_size
                     for wrap in (mlx_fsdp.ddp_step, mlx_fsdp.fsdp_step))
        return f"default ({_bucket(ddp)} / {_bucket(fsdp)})"
    return f"{size / MB:g} MiB" if size >= MB else f"{size / 1024:g} KiB"


def _point(r, cfg) -> str:
    return (f"| {r['device']} | {describe(cfg)} | {_count(r['num_params'])} | {r['dtype']} | "
            f"{_bucket(r['communication_size'])} |")


def modes_markdown(results, cfgs) -> str:
    """One row per mode of every point: times over the sharded step's and DDP's, peak over DDP's."""
    lines = [
        "| device | model | params | dtype | bucket | mode | step ms | time / sharded step | "
        "time / DDP | update ms | peak MiB | peak / DDP | params MiB/rank | state MiB/rank | "
        "max param diff vs DDP |",
        "|---|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, cfg in zip(results, cfgs):
        d, f = r["ddp"], r["fsdp"]
        for m in r["modes"]:
            q = r[m]
            diff = "-" if m == "ddp" else f"{q['max_param_diff']:.1e}"
            lines.append(
                f"{_point(r, cfg)} {LABELS[m]} | {q['step_ms_median']:.1f} | "
                f"{q['step_ms_median'] / f['step_ms_median']:.3f} | "
                f"{q['step_ms_median'] / d['step_ms_median']:.3f} | {q['update_ms_median']:.2f} | "
                f"{q['peak_mb']:.1f} | {q['peak_mb'] / d['peak_mb']:.3f} | {q['params_mb']:.2f} | "
                f"{q['state_mb']:.2f} | {diff} |")
    return "\n".join(lines)


def markdown(results, cfgs) -> str:
    """The sweep as one markdown table: a row per (device, model, dtype, bucket); with
    modes beyond DDP and FSDP, :func:`modes_markdown`'s table after it."""
    lines = [
        "| device | model | params | dtype | bucket | DDP ms | FSDP ms | time FSDP/DDP | "
        "DDP update ms | FSDP update ms | grads-only peak MiB | DDP peak MiB | FSDP peak MiB | "
        "peak FSDP/DDP | DDP state MiB/rank | FSDP state MiB/rank | state FSDP/DDP | "
        "peak saved / state dropped |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, cfg in zip(results, cfgs):
        d, f, q = r["ddp"], r["fsdp"], r["ratios"]
        lines.append(
            f"{_point(r, cfg)} "
            f"{d['step_ms_median']:.1f} | {f['step_ms_median']:.1f} | {q['time']:.3f} | "
            f"{d['update_ms_median']:.2f} | {f['update_ms_median']:.2f} | "
            f"{r['grads_peak_mb']:.1f} | {d['peak_mb']:.1f} | {f['peak_mb']:.1f} | {q['peak_memory']:.3f} | "
            f"{d['state_mb']:.2f} | {f['state_mb']:.2f} | {q['state_bytes']:.3f} | "
            f"{_ratio(q['peak_saved_per_state_dropped'])} |"
        )
    table = "\n".join(lines)
    if any(len(r["modes"]) > len(MODES) for r in results):
        table += "\n\n" + modes_markdown(results, cfgs)
    return table


def main(argv=None):
    """Run the sweep and print (rank 0) one table row per configuration."""
    args = parse_args(argv)
    if args.cpu:
        mx.set_default_device(mx.cpu)
    if args.memory_limit is not None:
        mx.set_memory_limit(args.memory_limit)
    group = lm.init_distributed()
    rank, n = group.rank(), group.size()
    device = f"{device_label()} ({mx.device_info().get('device_name', 'unnamed')})"
    # A collective probe on the first call: every rank must make it.
    method = mlx_fsdp.reduce_scatter_method(group) if n > 1 else "none (one process)"
    cfgs = configs(args)
    results = []
    for i, cfg in enumerate(cfgs):
        point = (f"{describe(cfg)} {cfg.dtype} bucket {_bucket(cfg.communication_size)}")
        progress = Progress(f"[{i + 1}/{len(cfgs)}] {point}", total_steps(cfg), enabled=rank == 0)
        x, y = make_batch(cfg, rank)
        results.append(run_config(cfg, group, x, y, progress))
        if rank == 0:
            q = results[-1]["ratios"]
            print(f"  {_count(results[-1]['num_params'])} {point}: time {q['time']:.3f}x, "
                  f"update hold {q['update']:.3f}x, peak {q['peak_memory']:.3f}x, "
                  f"state {q['state_bytes']:.3f}x (FSDP/DDP); peak saved / state dropped "
                  f"{_ratio(q['peak_saved_per_state_dropped'])}", file=sys.stderr, flush=True)
            for m in results[-1]["modes"][len(MODES):]:
                v = results[-1][m]["vs"]
                print(f"    {LABELS[m]}: time {v['time_vs_fsdp']:.3f}x the sharded step's, "
                      f"{v['time_vs_ddp']:.3f}x DDP's; peak {v['peak_vs_ddp']:.3f}x DDP's",
                      file=sys.stderr, flush=True)
    if rank != 0:
        return
    header = (
        f"world size {n}; device {device}; batch is rows per rank; AdamW lr {args.lr}, "
        f"max_norm {args.max_norm if args.max_norm > 0 else None}; FSDP reduce-scatter: {method}; "
        f"{args.steps} timed + {args.warmup} warm-up steps per mode (in blocks of {args.block}); "
        f"modes {' '.join(run_modes(args))}; "
        + (f"memory limit {_bucket(args.memory_limit)}; " if args.memory_limit is not None else "") +
        f"update = time opt.update holds the caller (median); "
        f"ms and MiB are the max over ranks; ideal state ratio 1/N = {1 / n:.3f}"
    )
    publish(header, markdown(results, cfgs), args.markdown, args.json,
            {"world_size": n, "device": device, "config": vars(args), "reduce_scatter_method": method,
             "mlx_version": mx.__version__, "results": results})


if __name__ == "__main__":
    main()
