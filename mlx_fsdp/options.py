"""The settings of a distributed step, validated once.

:func:`mlx_fsdp.fsdp_step`, :func:`mlx_fsdp.ddp_step` and
:func:`mlx_fsdp.fsdp_apply_gradients` all build an :class:`Options` with
:func:`make_options`, so every entry point refuses the same bad values with the
same message, before any collective starts.
"""

import math
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.optimizers as optim

from . import placement as _placement
from .watchdog import resolve_timeout

#: How gradients are accumulated over micro-batches.
ACCUMULATION_MODES = ("local", "sharded")

#: Bucket budgets when ``communication_size`` is left out. A GPU gets large
#: buckets: few collectives, each overlapping the backward pass. The CPU gets
#: small ones: a bucket's reduce-scatter and all-gather buffers are the
#: step's transient memory, and on one CPU stream nothing overlaps anyway
#: (4.2M MLP, ring N=2: peak 0.61-0.69x DDP's with 4 MiB, 0.82-0.90x with
#: 32 MiB, at about the same time). ``ddp_step`` keeps MLX's 32 MiB.
DEFAULT_SIZE_GPU = 32 * 1024**2
DEFAULT_SIZE_CPU = 4 * 1024**2

# What only the sharded step has.
_SHARDED_ONLY = {"dp_group", "placement", "accumulation"}

_global = []


def group_or_global(group):
    """``group`` itself, or the global group for ``None`` (MLX's convention).

    The global group is fetched once so that it is one Python object, and what
    is learned about it (its collectives' capabilities) is learned once.
    """
    if group is not None:
        return group
    if not _global:
        _global.append(mx.distributed.init())
    return _global[0]


@dataclass(frozen=True)
class Options:
    """Everything a distributed step needs besides the optimizer and the trees.

    See :func:`mlx_fsdp.fsdp_step` for the meaning of each field.
    """

    group: Any
    dp_group: Any = None
    max_norm: Optional[float] = None
    communication_size: Optional[int] = None
    communication_stream: Optional[mx.Stream] = None
    master_dtype: Optional[mx.Dtype] = None
    reduce_dtype: Optional[mx.Dtype] = None
    grad_accumulation_steps: int = 1
    accumulation: str = "local"
    placement: Any = None
    timeout: Optional[float] = None  # resolved: seconds, or None when the watchdog is off

    @property
    def world_size(self) -> int:
        """All data-parallel ranks: the shard group times the replica group."""
        return self.group.size() * (self.dp_group.size() if self.dp_group is not None else 1)


def _is_group(g) -> bool:
    return all(callable(getattr(g, name, None)) for name in ("rank", "size"))


def check_group(name: str, g):
    if g is not None and not _is_group(g):
        raise ValueError(
            f"{name}={g!r} is not an mx.distributed.Group; pass a group from "
            "mx.distributed.init() (or its split), or None for the global group."
        )


def _check_number(name: str, value, *, allow_none: bool, positive: bool, fix: str):
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (positive and not value > 0):
        need = "a finite number > 0" if positive else "a finite number"
        raise ValueError(f"{name}={value!r} must be {need}{' (or None)' if allow_none else ''}; {fix}")


def check_dtype(name: str, dtype):
    if dtype is not None and (not isinstance(dtype, mx.Dtype)
                              or not mx.issubdtype(dtype, mx.floating)):
        raise ValueError(
            f"{name}={dtype!r} must be a floating mlx dtype such as mx.float32 "
            "(or None to keep the gradients' or parameters' own dtype)."
        )


def as_number(value) -> Optional[float]:
    """``value`` as a float (finite or not) if it is a real number or a one-element real
    ``mx.array``; ``None`` for anything else (a string, a list, a bool)."""
    if isinstance(value, mx.array) and value.size == 1 and value.dtype != mx.bool_ \
            and not mx.issubdtype(value.dtype, mx.complexfloating):
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def check_learning_rate(part, value, when: str = "", scheduled: bool = False):
    """Raise unless the learning rate ``value`` of sub-optimizer ``part`` is a finite number.

    Args:
        part (mlx.optimizers.Optimizer): The (sub-)optimizer, named in the message.
        value: Its learning rate: what its state holds or its schedule returned.
        when (str): When, for the message, e.g. ``" at step 3"``. Default: ``""``.
        scheduled (bool): The value came from a schedule. Default: ``False``.
    """
    number = as_number(value)
    if value is None or number is not None and math.isfinite(number):
        return  # None: the optimizer has no rate (Adafactor's relative steps)
    fix = ("Check the schedule (a division by zero, a warmup of 0 steps, a bad flag)."
           if scheduled else "Check how the rate is computed (a division by zero, a bad flag), "
           "or set a finite one: opt.learning_rate = 1e-4.")
    raise ValueError(
        f"{type(part).__name__} has learning_rate={number if number is not None else value!r}"
        f"{when}{' from its schedule' if scheduled else ''}; it must be a finite number. {fix}")


def check_new_learning_rate(value):
    """What ``opt.learning_rate = value`` accepts: a finite number or a one-element array."""
    number = as_number(value)
    if number is None or not math.isfinite(number):
        raise ValueError(
            f"learning_rate={value!r} must be a finite number (a float or a one-element "
            "mx.array), e.g. opt.learning_rate = 1e-4. A schedule goes to the optimizer's "
            "constructor: optim.AdamW(learning_rate=optim.cosine_decay(1e-3, 1000)).")


def _check_learning_rates(optimizer):
    parts = optimizer.optimizers if isinstance(optimizer, optim.MultiOptimizer) else [optimizer]
    for part in parts:
        if "learning_rate" in getattr(part, "_schedulers", {}):
            continue  # a schedule is code; its values are checked at every step
        if "learning_rate" in part.state:
            check_learning_rate(part, part.state["learning_rate"])


def make_options(optimizer, *, sharded: bool, **kwargs) -> Options:
    """Validate the keyword arguments of a wrapper and return its :class:`Options`.

    Args:
        optimizer (mlx.optimizers.Optimizer): The optimizer to be wrapped.
        sharded (bool): ``True`` for ``fsdp_step`` (all options), ``False``
            for ``ddp_step`` (no ``dp_group``, ``placement`` or
            ``accumulation``: it accumulates locally).
        **kwargs: The fields of :class:`Options`; ``group=None`` means the
            global group.

    Raises:
        ValueError: Naming the bad value, the constraint and the fix.
    """
    if not isinstance(optimizer, optim.Optimizer):
        raise ValueError(
            f"optimizer={optimizer!r} is not an mlx.optimizers.Optimizer; wrap "
            "an optimizer instance, e.g. optim.AdamW(learning_rate=3e-4)."
        )
    _check_learning_rates(optimizer)
    allowed = set(Options.__dataclass_fields__) - (set() if sharded else _SHARDED_ONLY)
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        only = [k for k in unknown if k in _SHARDED_ONLY]
        name = "fsdp_step" if sharded else "ddp_step"
        what = (f"{only}, which only fsdp_step has" if only else f"the unknown option(s) {unknown}")
        raise ValueError(f"{name} got {what}; its options are {', '.join(sorted(allowed))}.")
    check_group("group", kwargs.get("group"))
    check_group("dp_group", kwargs.get("dp_group"))
    size = kwargs.get("communication_size")
    if size is None:
        gpu = mx.default_device() == mx.gpu
        size = DEFAULT_SIZE_GPU if gpu or not sharded else DEFAULT_SIZE_CPU
    opts = Options(**{**kwargs, "group": group_or_global(kwargs.get("group")),
                      "communication_size": size,
                      "timeout": resolve_timeout(kwargs.get("timeout"))})
    _check_number("max_norm", opts.max_norm, allow_none=True, positive=True,
                  fix="clipping to 0 would zero every update; pass None to disable clipping.")
    size = opts.communication_size
    if not isinstance(size, int) or isinstance(size, bool):
        raise ValueError(
            f"communication_size={size!r} must be an int number of bytes (<= 0 puts "
            "every array in its own bucket)."
        )
    if opts.communication_stream is not None and not isinstance(opts.communication_stream, mx.Stream):
        raise ValueError(
            f"communication_stream={opts.communication_stream!r} must be an mx.Stream, e.g. "
            "mx.new_stream(mx.default_device()), or None."
        )
    check_dtype("master_dtype", opts.master_dtype)
    check_dtype("reduce_dtype", opts.reduce_dtype)
    k = opts.grad_accumulation_steps
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(
            f"grad_accumulation_steps={k!r} must be an int >= 1 (1 steps on every call "
            "of update)."
        )
    if opts.accumulation not in ACCUMULATION_MODES:
        raise ValueError(
            f"accumulation={opts.accumulation!r} is not supported here; use one of "
            f"{', '.join(map(repr, ACCUMULATION_MODES))}."
        )
    if sharded:
        _placement.resolve(optimizer, opts.placement)
        _check_tiling(opts)
    return opts


def _check_tiling(opts: Options):
    if opts.dp_group is None:
        return
    world = group_or_global(None).size()
    if opts.group.size() * opts.dp_group.size() != world:
        raise ValueError(
            f"The shard group has {opts.group.size()} ranks and dp_group has "
            f"{opts.dp_group.size()}, but their product must be the world size {world} "
            "(each rank in exactly one shard and one replica group). Make both "
            "with mlx_fsdp.hybrid_groups(shard_size)."
        )
