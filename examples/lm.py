"""The pieces ``train.py`` and ``compare_ddp_fsdp.py`` share.

A byte-level GPT-style language model, its data (Python's own standard library
source by default, so nothing is downloaded), the global batches and each
rank's slice of them, the command-line flags, the optimizers, and the training
loop with its progress lines and checkpoints.

Every global batch is a pure function of ``(--seed, micro-batch index)``, and
rank ``r`` of ``N`` takes rows ``r * B/N`` to ``(r + 1) * B/N`` of it, so the
data a step sees, and the training result, do not depend on ``N``.
"""

import argparse
import gc
import math
import os
import re
import sys
import sysconfig
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

# Runs from a clone without installing: the repository root goes first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx_fsdp  # noqa: E402

VOCAB = 256
MODES = ("ddp", "fsdp", "fully_shard")
OPTIMIZERS = ("adamw", "muon", "sgd", "adafactor", "lion")
#: Learning rate used when --learning-rate is not given.
DEFAULT_LR = {"adamw": 3e-3, "muon": 3e-3, "sgd": 0.1, "adafactor": 3e-3, "lion": 3e-4}
_SIZE = re.compile(r"^\s*(\d+)\s*(|b|k|kb|kib|m|mb|mib|g|gb|gib)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1024**3, "gb": 1000**3, "gib": 1024**3}


# ----------------------------------------------------------------------------- data


def parse_size(text: str) -> int:
    """A byte count such as ``33554432``, ``32MiB``, ``512KiB`` or ``16M``.

    Args:
        text (str): The size; a bare number is bytes, ``K``/``M``/``G`` are binary.

    Returns:
        int: The number of bytes.
    """
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(
            f"size={text!r} is not a byte count; give an integer, optionally with "
            "a unit: 1048576, 1MiB, 512KiB, 32M."
        )
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def _text_files(root: str, suffix: str):
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorted, in place, so that every rank reads the same bytes in the same order.
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(suffix):
                yield os.path.join(dirpath, name)


def load_corpus(path: str = None, max_bytes: int = 8 * 1024**2) -> np.ndarray:
    """Bytes to train on, in a fixed order.

    Args:
        path (str, optional): A text file, or a folder whose files are read
            (recursively, sorted). ``None`` reads the ``.py`` files of Python's
            standard library, found with ``sysconfig``. Default: ``None``.
        max_bytes (int): Read at most this many bytes. Default: ``8 MiB``.

    Returns:
        numpy.ndarray: ``uint8`` array of the bytes.
    """
    if path is None:
        files = _text_files(sysconfig.get_paths()["stdlib"], ".py")
    elif os.path.isdir(path):
        files = _text_files(path, "")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise ValueError(f"--data={path!r} is neither a file nor a folder; give a text file or a folder of them.")
    chunks, total = [], 0
    for name in files:
        with open(name, "rb") as f:
            chunk = f.read(max_bytes - total)
        chunks.append(np.frombuffer(chunk, dtype=np.uint8))
        total += len(chunk)
        if total >= max_bytes:
            break
    data = np.concatenate(chunks) if chunks else np.zeros((0,), np.uint8)
    return data


def global_batch(data: np.ndarray, index: int, batch_size: int, seq_len: int, seed: int):
    """Global micro-batch number ``index``: the same on every rank and for every N.

    Args:
        data (numpy.ndarray): The corpus bytes.
        index (int): Micro-batch number (optimizer step times accumulation
            steps plus the micro-batch within the step).
        batch_size (int): Global rows.
        seq_len (int): Tokens per row.
        seed (int): The run's seed.

    Returns:
        tuple: ``(inputs, targets)``, ``int32`` arrays of shape ``(batch_size, seq_len)``;
        the targets are the inputs shifted by one byte.
    """
    if len(data) <= seq_len + 1:
        raise ValueError(
            f"The corpus has {len(data)} bytes; --seq-len={seq_len} needs at least "
            f"{seq_len + 2}. Give more text with --data or a shorter --seq-len."
        )
    rng = np.random.default_rng([seed, index])
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
    rows = data[starts[:, None] + np.arange(seq_len + 1)[None]].astype(np.int32)
    return rows[:, :-1], rows[:, 1:]


def rank_slice(batch, rank: int, size: int):
    """This rank's contiguous rows of a global batch, as MLX arrays.

    Args:
        batch (tuple): Arrays with the global batch on axis 0.
        rank (int): This rank.
        size (int): Number of ranks; must divide the batch.

    Returns:
        tuple: The same arrays, rows ``rank * B/size`` to ``(rank + 1) * B/size``.
    """
    rows = batch[0].shape[0]
    if rows % size:
        raise ValueError(
            f"--batch-size={rows} must divide by the number of ranks {size}; "
            f"use a multiple of {size}."
        )
    local = rows // size
    return tuple(mx.array(a[rank * local:(rank + 1) * local]) for a in batch)


# ----------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dims: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dims)
        self.attn = nn.MultiHeadAttention(dims, heads)
        self.norm2 = nn.LayerNorm(dims)
        self.up = nn.Linear(dims, 4 * dims)
        self.down = nn.Linear(4 * dims, dims)

    def __call__(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, mask=mask)
        return x + self.down(nn.gelu(self.up(self.norm2(x))))


class ByteGPT(nn.Module):
    """A small GPT over bytes: token and position embeddings, blocks, a linear head.

    Args:
        dims (int): Model width.
        layers (int): Number of blocks.
        heads (int): Attention heads; must divide ``dims``.
        seq_len (int): Longest sequence (size of the position table).
    """

    def __init__(self, dims: int, layers: int, heads: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dims)
        self.pos = nn.Embedding(seq_len, dims)
        self.blocks = [Block(dims, heads) for _ in range(layers)]
        self.norm = nn.LayerNorm(dims)
        self.head = nn.Linear(dims, VOCAB, bias=False)

    def __call__(self, x):
        length = x.shape[1]
        h = self.embed(x) + self.pos(mx.arange(length))
        mask = nn.MultiHeadAttention.create_additive_causal_mask(length).astype(h.dtype)
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.norm(h))


def loss_fn(model, x, y):
    """Mean next-byte cross-entropy, computed in float32 whatever the model dtype."""
    logits = model(x).astype(mx.float32)
    return nn.losses.cross_entropy(logits, y, reduction="mean")


def make_model(args, evaluate: bool = True) -> ByteGPT:
    """The model of ``args``, initialized from ``--seed`` (the same on every rank).

    With ``evaluate=False`` the parameters stay lazy, so that ``fully_shard``
    materializes one module's full parameters at a time (MLX's random
    initializers draw their keys when the model is built: the values are the
    same either way).
    """
    mx.random.seed(args.seed)
    model = ByteGPT(args.dims, args.layers, args.heads, args.seq_len)
    if args.dtype == "bfloat16":
        model.set_dtype(mx.bfloat16)
    if evaluate:
        mx.eval(model.parameters())
    return model


def fully_shard_model(model: ByteGPT, args, group, optimizer) -> nn.Module:
    """Each block, then the whole model, wrapped with ``mlx_fsdp.fully_shard``.

    ``placement=optimizer`` keeps the matrices Muon orthogonalizes (and every
    array Adafactor factors) whole on owner ranks; element-wise optimizers'
    arrays are split by rows.
    """
    kwargs = {"group": group, "placement": optimizer}
    if args.communication_size is not None:
        kwargs["communication_size"] = args.communication_size
    for i, block in enumerate(model.blocks):
        model.blocks[i] = mlx_fsdp.fully_shard(
            block, reshard_after_forward=args.reshard_after_forward, **kwargs)
    return mlx_fsdp.fully_shard(model, **kwargs)


def num_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


# ----------------------------------------------------------------------------- flags


def add_training_args(p: argparse.ArgumentParser):
    """Add the flags train.py and compare_ddp_fsdp.py share to ``p``."""
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH",
                   help="text file or folder to train on (default: the .py files of Python's stdlib)")
    g.add_argument("--max-data-bytes", type=parse_size, default=8 * 1024**2,
                   help="read at most this much text (default 8MiB)")
    g.add_argument("--batch-size", type=int, default=16,
                   help="global batch (rows per micro-batch, over all ranks; default 16)")
    g.add_argument("--seq-len", type=int, default=64, help="bytes per row (default 64)")
    g = p.add_argument_group("model")
    g.add_argument("--dims", type=int, default=64, help="model width (default 64)")
    g.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    g.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter dtype; bfloat16 keeps float32 master weights (default float32)")
    g = p.add_argument_group("optimization")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="muon = Muon for 2-D hidden weights, AdamW for the rest (default adamw)")
    g.add_argument("--learning-rate", type=float, default=None,
                   help="peak learning rate (default: " +
                   ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items()) + ")")
    g.add_argument("--muon-learning-rate", type=float, default=0.02,
                   help="Muon's own rate with --optimizer muon (default 0.02)")
    g.add_argument("--warmup-steps", type=int, default=5,
                   help="linear warm-up, then cosine decay to 10%% (default 5)")
    g.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    g.add_argument("--max-norm", type=float, default=0.0,
                   help="clip gradients to this global norm, e.g. 1.0; 0 disables (default 0)")
    g.add_argument("--grad-accumulation-steps", type=int, default=1,
                   help="micro-batches per optimizer step (default 1)")
    g.add_argument("--accumulation", choices=("local", "sharded"), default="local",
                   help="where FSDP accumulates gradients (default local)")
    g.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    g = p.add_argument_group("distributed")
    g.add_argument("--communication-size", type=parse_size, default=None,
                   help="bucket size, e.g. 32MiB or 1048576 (default: each wrapper's own: "
                   "fsdp_step 4MiB on the CPU and 32MiB on a GPU, ddp_step 32MiB)")
    g.add_argument("--reshard-after-forward", action="store_true",
                   help="with --mode fully_shard: free each block's gathered parameters after its "
                   "forward pass and recompute the block in the backward pass (less memory, "
                   "more compute)")
    g.add_argument("--timeout", type=float, default=None,
                   help="a rank that waits this many seconds in a collective prints where and "
                   "exits with code 124, so the launcher stops the job; 0 disables (default: "
                   "MLX_FSDP_TIMEOUT, else the library's 600)")
    g = p.add_argument_group("output and checkpoints")
    g.add_argument("--log-every", type=int, default=10,
                   help="rank 0 prints a progress line every this many steps (default 10)")
    g.add_argument("--save-every", type=int, default=0,
                   help="save a checkpoint every this many steps; 0 never (default 0)")
    g.add_argument("--checkpoint-dir", default="checkpoints",
                   help="where checkpoints go (default ./checkpoints)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir")


def check_args(p: argparse.ArgumentParser, args):
    """Refuse flag values that cannot work, before any rank starts a collective."""
    positive = ("batch_size", "seq_len", "dims", "layers", "heads", "steps",
                "grad_accumulation_steps", "log_every")
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1.")
    if args.dims % args.heads:
        p.error(f"--dims={args.dims} must divide by --heads={args.heads}.")
    if (args.max_norm < 0 or args.warmup_steps < 0 or args.save_every < 0
            or (args.timeout or 0) < 0):
        p.error("--max-norm, --warmup-steps, --save-every and --timeout must be >= 0.")
    if args.learning_rate is None:
        args.learning_rate = DEFAULT_LR[args.optimizer]


# ----------------------------------------------------------------------------- optimizers


def schedule(peak: float, warmup: int, steps: int, floor: float = 0.1):
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``floor * peak``.

    Steps count from 0. Steps ``0 .. warmup - 1`` ramp up to ``peak``; the
    cosine then runs from ``peak`` at step ``warmup`` to ``floor * peak`` at
    step ``steps - 1``, the run's last step, whenever at least two steps
    follow the warm-up (with fewer there is no decay to run).

    Args:
        peak (float): The highest learning rate.
        warmup (int): Warm-up steps.
        steps (int): Total optimizer steps of the run.
        floor (float): The last step's rate as a fraction of ``peak``. Default: ``0.1``.

    Returns:
        Callable: ``step -> learning rate``, usable as an MLX optimizer's
        ``learning_rate`` (the optimizer passes its 0-based step count).
    """

    def lr(step):
        step = mx.array(step).astype(mx.float32)
        warm = mx.minimum((step + 1) / max(warmup, 1), 1.0)
        # The decay spans steps warmup .. steps - 1, hence steps - 1 - warmup intervals.
        progress = mx.clip((step - warmup) / max(steps - 1 - warmup, 1), 0.0, 1.0)
        return peak * warm * (floor + (1 - floor) * 0.5 * (1 + mx.cos(math.pi * progress)))

    return lr


def schedules(args) -> dict:
    """The learning-rate schedules of ``args``: ``{"lr": ...}``, plus ``"muon lr"`` for Muon.

    With ``--optimizer muon`` the hidden matrices follow ``--muon-learning-rate``
    and everything else ``--learning-rate``, on the same warm-up and decay.
    """
    out = {"lr": schedule(args.learning_rate, args.warmup_steps, args.steps)}
    if args.optimizer == "muon":
        out["muon lr"] = schedule(args.muon_learning_rate, args.warmup_steps, args.steps)
    return out


def schedule_settings(args) -> dict:
    """The flags that shape the learning-rate schedule, as stored in checkpoints."""
    keys = ["optimizer", "learning_rate", "warmup_steps", "steps"]
    if args.optimizer == "muon":
        keys.append("muon_learning_rate")
    return {k: getattr(args, k) for k in keys}


def describe_rates(args) -> str:
    """The peak rates for a header line: ``adamw lr 0.003``, or both of Muon's."""
    if args.optimizer == "muon":
        return (f"muon lr {args.muon_learning_rate:g} (hidden matrices), "
                f"adamw lr {args.learning_rate:g} (the rest)")
    return f"{args.optimizer} lr {args.learning_rate:g}"


def describe_model(args) -> str:
    """The model's size for a header line: ``dims 256, 4 layers``."""
    return f"dims {args.dims}, {plural(args.layers, 'layer')}"


def plural(count: int, noun: str, suffix: str = "s") -> str:
    """``"1 rank"``, ``"2 ranks"``."""
    return f"{count} {noun}{'' if count == 1 else suffix}"


def _muon_param(path: str, weight) -> bool:
    # Muon orthogonalizes matrix updates; embeddings and the output head are
    # lookup tables / classifiers, and vectors have no matrix to orthogonalize.
    return weight.ndim >= 2 and not path.startswith(("embed.", "pos.", "head."))


def make_optimizer(args) -> optim.Optimizer:
    """The plain MLX optimizer ``--optimizer`` names, on the warm-up/cosine schedule."""
    rates = schedules(args)
    lr = rates["lr"]
    name = args.optimizer
    if name == "adamw":
        return optim.AdamW(learning_rate=lr, weight_decay=0.01)
    if name == "sgd":
        return optim.SGD(learning_rate=lr, momentum=0.9)
    if name == "lion":
        return optim.Lion(learning_rate=lr, weight_decay=0.01)
    if name == "adafactor":
        return optim.Adafactor(learning_rate=lr, relative_step=False, scale_parameter=False)
    if name == "muon":
        muon = optim.Muon(learning_rate=rates["muon lr"])
        return optim.MultiOptimizer([muon, optim.AdamW(learning_rate=lr, weight_decay=0.01)],
                                    [_muon_param])
    raise ValueError(f"--optimizer={name!r} is not one of {', '.join(OPTIMIZERS)}.")


def distributed_optimizer(mode: str, args, group):
    """``make_optimizer(args)`` wrapped by ``mlx_fsdp.fsdp_step`` (modes ``fsdp`` and
    ``fully_shard``) or ``ddp_step``.

    Options that keep their default are not passed, so the call stays the
    plain one the package has always accepted.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {', '.join(MODES)}.")
    kwargs = {"group": group,
              "max_norm": args.max_norm if args.max_norm > 0 else None,
              "timeout": args.timeout}  # 0 turns the watchdog off
    if args.communication_size is not None:
        kwargs["communication_size"] = args.communication_size
    if args.grad_accumulation_steps > 1:
        kwargs["grad_accumulation_steps"] = args.grad_accumulation_steps
        if mode != "ddp":
            kwargs["accumulation"] = args.accumulation
    if args.dtype == "bfloat16":
        kwargs["master_dtype"] = mx.float32
    wrap = mlx_fsdp.ddp_step if mode == "ddp" else mlx_fsdp.fsdp_step
    return wrap(make_optimizer(args), **kwargs)


def state_bytes(opt) -> int:
    """Bytes of this rank's optimizer state (arrays with at least one dimension)."""
    return sum(v.nbytes for _, v in tree_flatten(opt.state) if isinstance(v, mx.array) and v.ndim)


# ----------------------------------------------------------------------------- training


def _latest_checkpoint(directory: str):
    steps = []
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            m = re.fullmatch(r"step_(\d+)", name)
            if m:
                steps.append(int(m.group(1)))
    return max(steps) if steps else None


def schedule_change(saved: dict, args, step: int):
    """What changes when a run saved with schedule ``saved`` resumes at ``step`` under ``args``.

    Args:
        saved (dict): :func:`schedule_settings` of the saved run, or ``None``
            for a checkpoint that did not record it.
        args (argparse.Namespace): This run's flags.
        step (int): The first (0-based) step this run takes.

    Returns:
        str: A warning naming the settings that differ and the rates at
        ``step`` under both schedules, or ``None`` when nothing differs.
    """
    now = schedule_settings(args)
    if not saved or saved == now:
        return None
    changed = [k for k in now if saved.get(k) != now[k]]
    flags = {k: f"--{k.replace('_', '-')}" for k in changed}
    old = argparse.Namespace(**{**vars(args), **saved})
    then = schedules(old) if saved.get("optimizer") == args.optimizer else {}
    rates = [f"{name} {rate(step).item():.2e} (saved run's schedule: {then[name](step).item():.2e})"
             for name, rate in schedules(args).items() if name in then]
    length = "the schedule's length differs from the saved run's" if saved.get("steps") != args.steps \
        else "the schedule differs from the saved run's"
    return (f"{length} ({', '.join(f'{flags[k]} {saved.get(k)} -> {now[k]}' for k in changed)}); "
            f"the learning rate follows this run's flags from step {step + 1}" +
            (f": {', '.join(rates)}" if rates else "") + ". To continue the saved schedule, resume with " +
            " ".join(f"{flags[k]} {saved.get(k)}" for k in changed) + ".")


def _max_over_ranks(value: float, group) -> float:
    if group.size() == 1:
        return value
    return mx.distributed.all_gather(mx.array([value], mx.float32), group=group).max().item()


def train(mode: str, args, data: np.ndarray, group, *, checkpoint_dir=None, tag: str = None):
    """Train one model with ``mode`` and return what happened.

    Rank 0 prints a progress line every ``--log-every`` steps, the path of
    each checkpoint it saves, and a warning when it resumes a run saved with
    another schedule. Every rank must call this (the loss is all-summed every step).

    Args:
        mode (str): ``"ddp"``, ``"fsdp"`` or ``"fully_shard"`` (parameters
            sharded too: see :func:`fully_shard_model`).
        args (argparse.Namespace): The training flags.
        data (numpy.ndarray): The corpus bytes, the same on every rank.
        group (mlx.core.distributed.Group): The data-parallel group.
        checkpoint_dir (str, optional): Where to save/resume. Default: ``args.checkpoint_dir``.
        tag (str, optional): Prefix of the progress lines. Default: ``mode``.

    Returns:
        dict: ``loss`` (global mean per optimizer step), ``step_ms``,
        ``tokens_per_s``, ``lr`` (and ``muon_lr`` with Muon), ``peak_memory`` (bytes, max over ranks),
        ``state_bytes`` (this rank's optimizer state), ``params``, ``first_step``.
    """
    rank, n = group.rank(), group.size()
    k = args.grad_accumulation_steps
    checkpoint_dir = checkpoint_dir or args.checkpoint_dir
    tag = tag or mode
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()

    model = make_model(args, evaluate=mode != "fully_shard")
    params = num_params(model)
    opt = distributed_optimizer(mode, args, group)
    if mode == "fully_shard":
        model = fully_shard_model(model, args, group, opt.optimizer)
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    rates = schedules(args)

    start = 0
    if args.resume:
        last = _latest_checkpoint(checkpoint_dir)
        if last is not None:
            manifest = mlx_fsdp.load_checkpoint(os.path.join(checkpoint_dir, f"step_{last:06d}"),
                                                model, opt)
            start = last
            if rank == 0:
                print(f"[{tag}] resumed from {checkpoint_dir}/step_{last:06d}", flush=True)
                warning = schedule_change((manifest.get("user") or {}).get("schedule"), args, last)
                if warning:
                    print(f"[{tag}] warning: {warning}", file=sys.stderr, flush=True)
        elif rank == 0:
            print(f"[{tag}] no checkpoint in {checkpoint_dir}; starting from step 0", flush=True)

    tokens_per_step = args.batch_size * args.seq_len * k
    out = {"loss": [], "step_ms": [], "tokens_per_s": [], **{k.replace(" ", "_"): [] for k in rates},
           "params": params, "first_step": start}
    for step in range(start, args.steps):
        tic = time.perf_counter()
        total = mx.array(0.0)
        for micro in range(k):
            x, y = rank_slice(global_batch(data, step * k + micro, args.batch_size,
                                           args.seq_len, args.seed), rank, n)
            loss, grads = loss_and_grad(model, x, y)
            # With accumulation the wrapper steps the model on every k-th call.
            opt.update(model, grads)
            total = total + loss
            mx.eval(total, model.parameters(), opt.state)
        total = mx.distributed.all_sum(total, group=group) if n > 1 else total
        loss = total.item() / (n * k)
        ms = 1e3 * (time.perf_counter() - tic)
        out["loss"].append(loss)
        out["step_ms"].append(ms)
        out["tokens_per_s"].append(tokens_per_step / (ms / 1e3))
        for name, rate in rates.items():
            out[name.replace(" ", "_")].append(rate(step).item())
        done = step + 1
        if rank == 0 and (done % args.log_every == 0 or done == args.steps or step == start):
            window = out["step_ms"][-args.log_every:]
            mean_ms = sum(window) / len(window)
            print(f"[{tag}] step {done:5d} | loss {loss:7.4f} | "
                  f"{tokens_per_step / (mean_ms / 1e3):9.0f} tok/s | {mean_ms:7.1f} ms/step | "
                  f"peak {mx.get_peak_memory() / 1024**2:7.1f} MiB | " +
                  " | ".join(f"{name} {out[name.replace(' ', '_')][-1]:.2e}" for name in rates),
                  flush=True)
        if args.save_every and (done % args.save_every == 0 or done == args.steps):
            os.makedirs(checkpoint_dir, exist_ok=True)
            path = os.path.join(checkpoint_dir, f"step_{done:06d}")
            mlx_fsdp.save_checkpoint(path, model, opt, metadata={"schedule": schedule_settings(args)})
            if rank == 0:
                print(f"[{tag}] saved {path}", flush=True)

    out["state_bytes"] = state_bytes(opt)
    # What this rank holds of the parameters (all of them unless fully sharded), max over ranks.
    out["param_bytes"] = int(_max_over_ranks(
        float(sum(v.nbytes for _, v in tree_flatten(model.parameters()))), group))
    out["peak_memory"] = int(_max_over_ranks(float(mx.get_peak_memory()), group))
    # Drop the optimizer (it may hold split groups) before the caller moves on.
    del opt, model, loss_and_grad
    gc.collect()
    return out


def init_distributed():
    """The global group, with a warning when MPI started several processes that MLX could not join."""
    group = mx.distributed.init()
    launched = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or 1)
    if group.size() == 1 and launched > 1:
        print(f"warning: {launched} MPI processes started but MLX formed a group of 1; "
              "with Debian's openmpi-bin set MLX_MPI_LIBNAME=libmpi.so.40 and pass it "
              "with mpirun -x MLX_MPI_LIBNAME.", file=sys.stderr)
    return group
