"""The wrapper internals that saving and loading use, in one place to re-point.

:func:`agree` is the cross-rank agreement that opens ``save_checkpoint`` and
``load_checkpoint`` (:func:`mlx_fsdp.control.agree`), on the wrapper's
communication stream and under its watchdog; the other helpers give the plan
and shard of the state a wrapper holds, and reset a wrapper after a load.
A change to the wrapper's attributes is made here, not in :mod:`.save` and
:mod:`.load`.
"""

import os
from typing import Optional

from .. import control, watchdog
from ..options import group_or_global
from .layout import is_sharded, one_shard_plan

#: The slowest storage a checkpoint is expected on, in bytes per second.
#: While a rank waits for its peers' checkpoint I/O, the watchdog allows the
#: time these bytes take at this rate on top of its timeout. Measured: on the
#: development VM's shared disk, rank 0's part of a 3 GiB save went at 59 MB/s
#: (the others waited 73 s for it); 25 MB/s leaves a margin of 2.4.
SLOWEST_STORAGE = 25e6

#: How to fix a failed agreement between the ranks.
HINT = ("Call save_checkpoint and load_checkpoint on every rank, at the same point of the "
        "training loop, with the same path.")


def save_layout(wrapper, model, optimizer, rank: int):
    """``(plan, shard index, whether this rank writes its shard)`` of the state to save."""
    if is_sharded(wrapper):
        if wrapper.plan is None:
            wrapper.init(model.trainable_parameters())
        writer = wrapper.dp_group is None or wrapper.dp_group.rank() == 0
        return wrapper.plan, wrapper.group.rank(), writer
    return one_shard_plan(model, optimizer), 0, rank == 0


def load_target(wrapper, model):
    """``(plan, shard rank)`` of the state a sharded wrapper steps with, or ``(None, 0)``."""
    if not is_sharded(wrapper):
        return None, 0
    return wrapper.plan_of(model.trainable_parameters()), wrapper.options.group.rank()


def reset_wrapper(wrapper, master: Optional[dict], plan):
    """Give ``wrapper`` the loaded masters, and the plan they were cut for (if any)."""
    # The setter gives the other entries (micro-batches, norm) their fresh values
    # and forgets the plan; the loaded state is adopted for the plan it was cut for.
    state = {k: v for k, v in wrapper.state.items() if k not in ("master", "grad_norm")}
    state["master"] = master if master is not None else {}
    wrapper.state = state
    if plan is not None:
        wrapper._adopt(plan)


def io_allowance(nbytes: float) -> float:
    """Seconds the peers may spend reading or writing ``nbytes`` while this rank waits."""
    return nbytes / SLOWEST_STORAGE


def read_allowance(path: str, world_size: int) -> float:
    """The :func:`io_allowance` of a load: the largest file (the model) and 1/N of the rest,
    each read twice (checksum, then arrays)."""
    try:
        sizes = [e.stat().st_size for e in os.scandir(path) if e.is_file()]
    except OSError:
        return 0.0
    return io_allowance(2 * (max(sizes, default=0) + sum(sizes) / max(world_size, 1)))


def watched(wrapper, where: str, allowance: float = 0.0):
    """The wrapper's collective watchdog around a wait in ``where`` (a no-op without one).

    A plain optimizer (``wrapper=None``) has the job's default watchdog.
    """
    dog = wrapper._dog if wrapper is not None else watchdog.default(group_or_global(None))
    return watchdog.watch(dog, where, allowance)


def agree(wrapper, world, operation: str, path: str, fields: dict, hint: str = HINT,
          allowance: float = 0.0):
    """Check that every rank of ``world`` is in ``operation`` with the same ``fields``.

    Args:
        wrapper: The mlx_fsdp wrapper, or ``None`` for a plain optimizer.
        world (mlx.core.distributed.Group): The ranks that must agree.
        operation (str): ``"save_checkpoint"`` or ``"load_checkpoint"``.
        path (str): The checkpoint path, named if the watchdog fires.
        fields (dict): What must be equal on every rank.
        hint (str): How to fix a disagreement. Default: :data:`HINT`.
        allowance (float): Seconds of the peers' file I/O the watchdog allows
            on top of its timeout. Default: ``0``.

    Raises:
        mlx_fsdp.control.RankMismatch: On every rank, if the ranks are not all
            in ``operation`` or a field differs.
        mlx_fsdp.control.PeerLost: If a peer left.
    """
    # On the wrapper's communication stream, in order with its step's collectives.
    with watched(wrapper, f"{operation}({path})", allowance):
        control.agree(world, operation, fields, hint=hint,
                      stream=getattr(wrapper, "communication_stream", None))
