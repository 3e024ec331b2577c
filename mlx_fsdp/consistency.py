"""The per-step check that every rank takes the same step with the same settings.

Ranks that disagree on the plan (a tree that changed on one rank), the
optimizer class, a hyper-parameter, the learning rate of this step, the clip
bound, accumulation or the step count would otherwise issue collectives of
different sizes and hang, or train on with diverging parameters. Before a
step's first collective, every rank sends these values in one fixed-size
control message (:func:`mlx_fsdp.control.agree`), so a difference raises the
same :class:`~mlx_fsdp.control.RankMismatch` on every rank, naming the
setting and the ranks.

Inside ``mx.compile`` the step's Python runs once, while tracing: the check
then runs once per trace, on the settings (the step count and the learning
rate are traced values and are left out).
"""

import functools
import hashlib
import struct
from typing import Optional

import mlx.optimizers as optim

from . import control
from .placement import sub_optimizers
from .plan import dtype_name
from .options import as_number, check_learning_rate
from .watchdog import watch


def _hyperparameters(optimizer) -> str:
    # Public attributes with plain values (betas, eps, weight_decay...), the
    # way the optimizer's own __init__ stored them.
    fields = ", ".join(f"{k}={v!r}" for k, v in sorted(vars(optimizer).items())
                       if not k.startswith("_") and isinstance(v, (bool, int, float, str, tuple, list)))
    return f"{type(optimizer).__name__}({fields})"


def describe(optimizer) -> str:
    """The optimizer's classes and hyper-parameters (not the learning rate), as text."""
    if isinstance(optimizer, optim.MultiOptimizer):
        return "MultiOptimizer[" + "; ".join(_hyperparameters(o) for o in optimizer.optimizers) + "]"
    return _hyperparameters(optimizer)


def current_rates(optimizer) -> list:
    """``(sub-optimizer, scheduled, learning rate)`` of what each next update uses.

    The rate is what the state holds or what the schedule returns for the
    next step, as it is (an array, a number, or whatever a bad schedule gave).
    """
    out = []
    for sub in sub_optimizers(optimizer):
        schedule = getattr(sub, "_schedulers", {}).get("learning_rate")
        lr = schedule(sub.step) if schedule is not None else sub.state.get("learning_rate")
        out.append((sub, schedule is not None, lr))
    return out


def learning_rates(rates: list) -> str:
    """The rates of :func:`current_rates` exactly (``repr`` of float32 values), as text."""
    texts = []
    for _, _, lr in rates:
        number = as_number(lr)
        texts.append("none" if lr is None else repr(lr)[:40] if number is None else
                     float32_text(number))
    return ",".join(texts)


def float32_text(number: float) -> str:
    """The shortest text that reads back as the same float32 as ``number``.

    The learning rate is a float32 array: two ranks whose rates round to
    the same float32 agree. (numpy's ``str(np.float32(x))`` says the same;
    importing numpy would add about 0.1 s to the start of every process.)
    """
    as_float32 = struct.unpack("f", struct.pack("f", number))[0]
    for digits in range(1, 10):  # 9 significant digits always read back
        text = f"{as_float32:.{digits}g}"
        if struct.unpack("f", struct.pack("f", float(text)))[0] == as_float32:
            return text
    return repr(as_float32)


@functools.lru_cache(maxsize=64)
def tree_fingerprint(signature: tuple) -> str:
    """A digest of a gradient tree's signature (paths, shapes, dtypes)."""
    return hashlib.sha256(repr(signature).encode()).hexdigest()


def describe_tree(num_arrays: int, num_elements: int, fingerprint: str, extra: str = "") -> str:
    """What a plan or tree is, as the mismatch message shows it."""
    return f"{num_arrays} arrays, {num_elements} elements{extra} (#{fingerprint[:8]})"


def check_step(opts, optimizer, tree: str, state, *, tracing: bool, dog=None):
    """Raise on every rank unless all ranks take this step with the same settings.

    Every rank of ``opts.group`` (and of ``opts.dp_group``) must call it at
    the same point: it evaluates one small all-gather per group. On one rank
    it checks the learning rates only.

    Args:
        opts (Options): The wrapper's options.
        optimizer (mlx.optimizers.Optimizer): The wrapped optimizer.
        tree (str): The plan (sharded) or the gradient tree (replicated), as
            :func:`describe_tree` gives it.
        state (WrapperState): The wrapper's state (micro-step counter).
        tracing (bool): Inside ``mx.compile``: leave out the traced values.
        dog (Watchdog, optional): Watches the wait. Default: ``None``.

    Raises:
        mlx_fsdp.control.RankMismatch: If any field differs between ranks, or
            the ranks are at different synchronization points.
        ValueError: If a learning rate of this step is not a finite number.
    """
    step: Optional[int] = None
    micro: Optional[int] = None
    rates: Optional[list] = None
    if not tracing:
        step = int(sub_optimizers(optimizer)[0].step.item())
        micro = int(state["micro_step"].item())
        rates = current_rates(optimizer)
    if opts.world_size > 1:
        _agree(opts, optimizer, tree, step, micro, rates, dog)
    # After the agreement, so that a rate that differs between ranks is a
    # RankMismatch on every rank, and a bad rate they share fails on all of them.
    for sub, scheduled, lr in rates or ():
        check_learning_rate(sub, lr, f" at step {step}", scheduled)


def _agree(opts, optimizer, tree: str, step, micro, rates, dog):
    fields = {
        "world size": opts.world_size,
        "gradient tree and plan": tree,
        "optimizer and hyper-parameters": describe(optimizer),
        "learning rate of this step": None if rates is None else learning_rates(rates),
        "max_norm": None if opts.max_norm is None else float(opts.max_norm),
        "grad_accumulation_steps": opts.grad_accumulation_steps,
        "accumulation": opts.accumulation,
        "master_dtype": dtype_name(opts.master_dtype) if opts.master_dtype else None,
        "reduce_dtype": dtype_name(opts.reduce_dtype) if opts.reduce_dtype else None,
        "optimizer step count": step,
        "micro-batch count": micro,
    }
    where = f"the cross-rank check of step {step if step is not None else '(traced)'}"
    hint = ("Launch every rank with the same flags and code, give every rank the same model, "
            "and resume every rank from the same checkpoint.")
    for group in (opts.group, opts.dp_group):
        if group is not None:
            with watch(dog, where):
                control.agree(group, "update", fields, stream=opts.communication_stream, hint=hint)
