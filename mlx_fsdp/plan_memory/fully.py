"""What one rank holds under fully sharded training: ``fully_shard`` and ``fsdp_step``.

The model is wrapped per block and at the root (``wrap="blocks"``: every
module at a path's first integer component, e.g. ``model.layers.3``, then
the whole model for what is left: embeddings, final norm, head), or once as
a whole (``wrap="model"``). Each wrapped module (a *unit*) keeps what its
own plan gives this rank (the rule of :class:`mlx_fsdp.FullyShardedModule`,
:func:`mlx_fsdp.fully_sharded.placement.module_plan`): the axis-0 slice of every parameter,
``ceil(rows / N)`` rows, or, for an optimizer that needs whole arrays
(Muon, Adafactor; ``placement=optimizer``), whole arrays on owner ranks.
The step's state comes from the step's own plan
(:func:`mlx_fsdp.fully_sharded.model.model_plan`) and
:func:`mlx_fsdp.sharded_state.init_held`, as for ``fsdp_step``.

Per rank: **parameters** and **gradients** (what it holds, both in the
parameters' dtype; the gradients arrive reduced and shard-shaped), the
**accumulation** (``local`` and ``sharded`` both sum shard-shaped
gradients), **optimizer state** and **masters**. Then the fuller of two
phases:

* the forward and backward pass: the **gathered** parameters of the units
  alive at once (the root's for the whole pass; every block's from its
  forward to its backward pass, plus the largest gather's vector beyond
  them, the padding rows or a mostly padded owner bucket's; or, with
  ``reshard_after_forward``, :data:`BLOCKS_ALIVE` blocks' gathers, vectors
  included, since MLX allocates the outputs of the operations it has
  queued before they run, so that a block may gather again while the one
  after it has not freed its buffers), the **full gradients** of a unit
  (the largest of the blocks and the root, or the whole model wrapped
  once: the gather's VJP receives all its cotangents at once; with
  ``reshard_after_forward``, the root's and :data:`BLOCKS_ALIVE` blocks'),
  and in **comm** the reduce-scatter buffers of the largest bucket (as for
  ``fsdp_step``, see :func:`~mlx_fsdp.plan_memory.buffers.reduce_buffers`)
  and its sum, from which the shard's gradient is then made in the shard's
  dtype and row order;
* the optimizer step: the gradients divided by ``N`` (**comm**, as large
  as the gradients, alive until each update) and one array's **new**
  shard.

Given a batch, the **activations** are added, and the optimizer's
**temporaries**, to both phases, as in the other modes
(:mod:`mlx_fsdp.plan_memory.estimate`), except on the CPU: there the update
waits for the whole backward pass, so the pass is counted with its
activations and the update with its temporaries, each alone (the parts of
the other phase are 0 in the table; :mod:`mlx_fsdp.plan_memory.phases`),
and a unit's reduce-scatter meets the activations less that unit's share
(:func:`~mlx_fsdp.plan_memory.backward.reduced_after_blocks`).
docs/memory-planner.md states the margin measured against
``mx.get_peak_memory``.
"""

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx

from .. import layout, pace
from ..fully_sharded.model import model_plan
from ..fully_sharded.placement import module_plan, owned_loads
from ..plan import Plan
from ..sharded_state import init_held
from .buffers import reduce_buffers
from .sharding import bucket_bytes

#: How the model is wrapped: each block and the root, or the whole model once.
WRAPS = ("blocks", "model")

#: With ``reshard_after_forward``, the blocks whose gathered parameters and full
#: gradients are counted alive at once, by device (see :func:`cut`). On the CPU,
#: where evaluation is paced at every block (:mod:`mlx_fsdp.pace`), one, and
#: one more for the pass alone (:func:`mlx_fsdp.plan_memory.backward.pass_spare`);
#: three before the pacing. On a GPU it is not measured, and the count from
#: before the pacing stands.
BLOCKS_ALIVE = {"cpu": 1, "gpu": 3}

#: :data:`BLOCKS_ALIVE` on a CPU whose pacing is off (``pace.QUEUE_DEPTH`` 0):
#: as before the pacing. Counted with one, the MLP 6 x 384 with SGD at MPI N=3,
#: resharded, peaked at 8.35 MiB against 7.99 planned (session 49).
UNPACED_BLOCKS_ALIVE = 3


def split(paths: Sequence[str], wrap: str = "blocks") -> List[Tuple[str, List[int]]]:
    """The units ``fully_shard`` wraps: ``(prefix, indices of their own arrays)``.

    A block is the module at a path's first integer component
    (``model.layers.3.``, ``blocks.0.``); the root (prefix ``""``) keeps the
    arrays outside every block, and comes last. ``wrap="model"``: one unit.
    """
    if wrap not in WRAPS:
        raise ValueError(f"wrap={wrap!r} must be one of {', '.join(WRAPS)}.")
    if wrap == "model":
        return [("", list(range(len(paths))))]
    units: Dict[str, List[int]] = {}
    for i, path in enumerate(paths):
        parts = path.split(".")
        at = next((j for j, c in enumerate(parts) if c.isdigit()), None)
        prefix = "" if at is None else ".".join(parts[:at + 1]) + "."
        units.setdefault(prefix, []).append(i)
    root = units.pop("", None)
    return list(units.items()) + ([("", root)] if root else [])


class _Group(NamedTuple):
    """What the step's plan asks of a shard group."""

    n: int
    r: int

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


class _Module(NamedTuple):
    """What the step's plan asks of a ``FullyShardedModule``."""

    plan: Plan
    group: _Group


class Units(NamedTuple):
    """A model cut into wrapped units, with their plans and rank-independent bytes.

    Attributes:
        plans (list): ``(prefix, plan, [(local path, array)])`` per unit.
        trainable (set): The trainable arrays' paths.
        step (Plan): The step's plan (the same on every rank).
        gathered (int): Bytes of the full parameters alive at once.
        full_gradients (int): Bytes of the largest block's or the root's full gradients.
        communication (int): Reduce-scatter buffers of the largest bucket.
        spare (tuple): ``(gathered, full gradients)`` of one more block, the
            largest: what the CPU's pass alone was measured to hold beyond
            the count (:func:`mlx_fsdp.plan_memory.backward.pass_spare`).
        resharded (bool): Blocks are counted resharded after their forward pass.
        last (int): Bytes of the full parameters alive at the backward pass's
            end, beside every sharded gradient: the root's and one block's
            (its vector's too), or, resharded, ``gathered``.
        extra (int): Bytes of the largest gathered vector beyond what its
            copies keep (0 where no gather copies out): alive only until
            the copies are made, never beside a reduce-scatter's buffers.
        queued (int): ``communication`` of the largest bucket that is not an
            owner's (:attr:`~mlx_fsdp.plan_memory.sharding.BucketBytes.owned`):
            what a step compiled whole was measured to queue ahead
            (:data:`mlx_fsdp.plan_memory.fully_ranks.COMPILED_UNITS`).
    """

    plans: list
    trainable: set
    step: Plan
    gathered: int
    full_gradients: int
    communication: int
    spare: Tuple[int, int]
    resharded: bool
    last: int
    extra: int = 0
    queued: int = 0


def cut(flat: Sequence[Tuple[str, mx.array]], trainable: Sequence[str], optimizer,
        world_size: int, communication_size: int, wrap: str, reshard_after_forward: bool,
        method: str, device: str = "cpu") -> Units:
    """The units of a model and what its forward and backward pass keep alive.

    Args:
        flat (list): ``(path, array)`` of every floating array (shape-only).
        trainable (list[str]): The paths among them that are trained.
        optimizer: The optimizer (decides owner placement).
        world_size (int): Ranks.
        communication_size (int): Each unit's bucket budget.
        wrap (str): ``"blocks"`` or ``"model"``.
        reshard_after_forward (bool): As the blocks' ``fully_shard`` argument.
        method (str): The reduce-scatter (``"native"``, ``"exchange"``, ``"all_sum"``).
        device (str): ``"cpu"`` or ``"gpu"`` (see :data:`BLOCKS_ALIVE`). Default: ``"cpu"``.
    """
    trained = set(trainable)
    alive_blocks = UNPACED_BLOCKS_ALIVE if pace.unpaced_cpu(device) else BLOCKS_ALIVE[device]
    plans, gathered, loads = [], [], ()
    parts = split([p for p, _ in flat], wrap)
    for prefix, indices in parts:
        own = [(flat[i][0][len(prefix):], flat[i][1]) for i in indices]
        # fully_shard's own rule, owners balanced over the units as it balances them
        plan = module_plan(own, [p for p, _ in own if prefix + p in trained], optimizer,
                           world_size, communication_size, owner_loads=loads)
        loads = owned_loads(plan, loads)
        plans.append((prefix, plan, own))
        gathered.append((prefix, *_gather_bytes(plan, [a for _, a in own], world_size)))
    blocks = sorted((kept + extra for prefix, kept, extra in gathered if prefix), reverse=True)
    ahead = reshard_after_forward and wrap == "blocks" and blocks
    if ahead:
        # MLX allocates the outputs of the operations it has queued before
        # they run: unpaced, while one block's backward pass runs, the block
        # after it may not have freed its gathered parameters and full
        # gradients yet, and the block before it gathers already (on the CPU
        # before the pacing, two blocks counted were measured too few).
        alive = sum(kept + extra for prefix, kept, extra in gathered if not prefix) + \
            sum(blocks[:alive_blocks])
    else:  # what the gathers keep, and one gather's vector
        alive = sum(kept for _, kept, _ in gathered) + max((extra for _, _, extra in gathered),
                                                         default=0)
    # Blocks not resharded free their parameters one by one in the backward
    # pass as their sharded gradients come: at its end the root's and one
    # block's are left (mlx_fsdp.plan_memory.backward.pass_walk).
    last = alive if ahead else sum(kept for prefix, kept, _ in gathered if not prefix) + \
        max((kept for prefix, kept, _ in gathered if prefix), default=0) + \
        max((extra for _, _, extra in gathered), default=0)
    grads = {prefix: sum(flat[i][1].nbytes for i in indices if flat[i][0] in trained)
             for prefix, indices in parts}
    spare = max(((sum(flat[i][1].nbytes for i in indices), grads[prefix])
                 for prefix, indices in parts if prefix),
                key=sum, default=(0, 0))
    if ahead:  # the root's until the end of the backward pass, and the blocks' in flight
        full = grads.pop("", 0) + sum(sorted(grads.values(), reverse=True)[:alive_blocks])
    else:  # a unit's until its reduce-scatter, the root's until the end
        full = max(grads.values(), default=0)
    # The reduce-scatter's buffers, and its sum, which the gradient of the
    # shard's own dtype and row order (columns.row_major) is then made from.
    sized = [bucket_bytes(b, [a for _, a in own], world_size, 0)
             for _, plan, own in plans for b in plan.buckets]
    comm = max((reduce_buffers(bb, method) + bb.held for bb in sized), default=0)
    queued = max((reduce_buffers(bb, method) + bb.held for bb in sized if not bb.owned),
                 default=0)
    # Every rank builds the same step plan; rank 0's gradients' shapes are checked.
    flat_grads = _held(plans, trained, 0)[3]
    modules = [(prefix, _Module(plan, _Group(world_size, 0))) for prefix, plan, _ in plans]
    step = model_plan(flat_grads, [a for _, a in flat_grads], optimizer, world_size, 0, None,
                      modules)
    extra = max((extra for _, _, extra in gathered), default=0)
    return Units(plans, trained, step, alive, full, comm, spare, bool(ahead), min(last, alive),
                 extra, queued)


def _gather_bytes(plan: Plan, arrays: Sequence[mx.array], world_size: int) -> Tuple[int, int]:
    """What one unit's gather keeps until the backward pass, and what it holds
    on top while it runs.

    :func:`mlx_fsdp.layout.unpack` returns views of each bucket's gathered
    vector (an all-summed bucket's: its arrays alone, :mod:`mlx_fsdp.summed`),
    which keep the whole vector alive, padding included, as long as the
    arrays; or, where a quarter of an owner bucket's vector is padding, or a
    rows bucket holds several arrays, copies, and then only the copies are
    kept and the vector is freed once they are made.
    """
    kept = extra = 0
    for b in plan.buckets:
        sized = bucket_bytes(b, arrays, world_size, 0)
        vector = sized.gathered
        own = sum(arrays[s.index].nbytes for s in b.slots)
        if b.by_rows and len(b.slots) > 1:  # copied run by run: the rest of the vector
            kept, extra = kept + own, extra + vector - own
        elif sized.copied:  # copied out whole (layout.copies_out): and the vector
            kept, extra = kept + own, extra + vector
        else:
            kept += vector
    return kept, extra


def _held(plans, trained: set, rank: int):
    """``rank``'s parameter and gradient bytes, its largest gradient, and its gradients
    (shape-only, by their paths in the wrapped model, in the step plan's order)."""
    params = grads = largest = 0
    flat_grads = []
    for prefix, plan, own in plans:
        arrays = [a for _, a in own]
        for b in plan.buckets:
            for s, a in layout.held_of(b, arrays, rank):
                params += a.nbytes
                if prefix + s.path in trained:
                    grads += a.nbytes
                    largest = max(largest, a.nbytes)
            flat_grads += [(f"{prefix}module.{s.path}",
                            mx.zeros(layout.held_shape(b, s, rank), arrays[s.index].dtype))
                           for s in b.slots if prefix + s.path in trained]
    return params, grads, largest, flat_grads


def rank_bytes(units: Units, optimizer, rank: int,
               master_dtype: Optional[mx.Dtype]) -> Dict[str, object]:
    """What ``rank`` holds: parameters, gradients, optimizer state, masters, largest piece.

    Returns:
        dict: ``"parameters"``, ``"gradients"``, ``"largest"`` (bytes),
        ``"optimizer"``, ``"master"`` (the state trees, shape-only) and
        ``"pieces"`` (``(path, array)`` of the gradients it updates, shape-only).
    """
    params, grads, largest, flat_grads = _held(units.plans, units.trainable, rank)
    masters: dict = {}
    init_held(units.step, optimizer, [a for _, a in flat_grads], rank, masters, master_dtype)
    return {"parameters": params, "gradients": grads, "largest": largest,
            "optimizer": optimizer.state, "master": masters, "pieces": flat_grads}
