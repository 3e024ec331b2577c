"""What one FSDP rank holds: the planner's only link to the sharded step's layout.

Everything the planner says about ``fsdp_step`` that depends on how the step
cuts arrays (padding, owner ranks, bucket sizes) comes from
:func:`_fsdp_state`, which asks the step's own plan. When the layout
changes, this is the one function to follow it.
"""

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx
from mlx.utils import tree_unflatten

from .. import layout, master, summed
from ..sharded_state import init_held
from ..placement import plan_for


def plain_state(optimizer, flat_params: Sequence[Tuple[str, mx.array]],
                master_dtype: Optional[mx.Dtype] = None) -> Dict[str, dict]:
    """What the plain optimizer keeps (every rank of ``ddp_step``), built lazily.

    Mirrors ``ReplicatedOptimizer.init``: masters of the parameters of another
    dtype, and the optimizer initialized on the tree (so that a
    ``MultiOptimizer``'s filters see the real paths).

    Returns:
        dict: ``"optimizer"``: the state tree; ``"master"``: ``{path: master}``.
    """
    masters = {}
    paths = [p for p, _ in flat_params]
    steps = master.initial(paths, [a for _, a in flat_params], masters, master_dtype)
    optimizer.init(tree_unflatten(list(zip(paths, steps))))
    return {"optimizer": optimizer.state, "master": masters}


class BucketBytes(NamedTuple):
    """What one bucket's step moves through one rank, in bytes.

    Attributes:
        vector (int): The bucket's flat vector in the reduce dtype, padding
            included: what an all-sum or the two-rank exchange returns.
        shard (int): This rank's ``1/N`` of it: what a native reduce-scatter
            returns.
        held (int): This rank's pieces of the arrays (padding excluded), as
            the step reduces and updates them.
        packed (int): The updated pieces concatenated into the shard the
            all-gather sends; 0 where the shard is one piece, sent as it is.
        gathered (int): The all-gathered vector in the parameters' dtype,
            whose views are the bucket's new parameters.
        summed (bool): An owner bucket all-summed without its padding
            (:mod:`mlx_fsdp.summed`): ``vector`` and ``gathered`` are its
            arrays alone, and ``shard`` what this rank keeps of them.
        owned (bool): Its arrays are kept whole on owner ranks; on the CPU
            only the other buckets' all-gathers wait for their updates
            (:mod:`mlx_fsdp.step`).
        copies (int): What packing allocates beside the vector: the zeros
            of its padding, and the gradients flattening copies. Row by row
            (owner buckets) a ``Linear`` weight's gradient, a transposed
            view, is copied; in column order (a flat bucket's matrices) a
            row-major one, an embedding's. Where the model does not say
            (:attr:`~mlx_fsdp.plan_memory.shapes.Array.transposed`), every
            array of two or more dimensions is counted.
        sent_copies (int): The same under the two-rank exchange, which
            packs only the peer's half; where it flattens an array on both
            sides of the split (a flat bucket's), twice.
        padding (int): The gathered vector's padding in the parameters'
            dtype: where the new parameters are views of that vector, the
            model keeps it from the first step on.
        copied (int): What :func:`mlx_fsdp.layout.unpack` copies out of
            the gathered vector (its arrays, where a quarter or more of it is
            padding, :func:`mlx_fsdp.layout.copies_out`), so that the vector
            and its padding are freed once the copies are made.
        slots (int): Its arrays: the two-rank exchange packs the half it
            sends into a vector of its own unless it is one array's
            (:func:`mlx_fsdp.plan_memory.buffers.reduce_buffers`).
        elsewhere (int): An owner bucket's arrays another rank updates, in
            the parameters' dtype, where their old values have buffers of
            their own (copied out, or none of the bucket this rank's):
            freed once the model lets them go
            (:mod:`mlx_fsdp.plan_memory.freed`).
    """

    vector: int
    shard: int
    held: int
    packed: int
    gathered: int
    summed: bool = False
    owned: bool = False
    copies: int = 0
    sent_copies: int = 0
    padding: int = 0
    slots: int = 1
    copied: int = 0
    elsewhere: int = 0

    @property
    def kept_padding(self) -> int:
        """The padding the new parameters keep alive between steps."""
        return 0 if self.copied else self.padding

    @property
    def new_parameters(self) -> int:
        """What its gather holds at once: the vector and the copies made of it."""
        return self.gathered + self.copied


def bucket_bytes(bucket, arrays: Sequence[mx.array], world_size: int, rank: int,
                 transposed: Optional[dict] = None) -> BucketBytes:
    """The bytes ``rank`` handles in ``bucket``'s step, from the step's own layout functions.

    ``transposed``: ``{path: bool}``, how gradients arrive where known
    (:attr:`~mlx_fsdp.plan_memory.shapes.Array.transposed`).
    """
    itemsize = getattr(mx, bucket.dtype).size
    param_dtype = getattr(mx, bucket.param_dtype)
    mine = {s.index: a for s, a in layout.held_of(bucket, arrays, rank)}
    held = sum(a.size for a in mine.values()) * itemsize
    # Copied unless the order fits how it arrives: column order (mlx_fsdp.flat)
    # a transposed view, row order a row-major gradient.
    # (fully_shard's rows buckets flatten each rank's rows, in the order the
    # gradient arrives: counted in mlx_fsdp.plan_memory.fully.)
    kinds = transposed or {}
    copied = [s for s in bucket.slots if not bucket.by_rows and len(s.shape) >= 2
              and kinds.get(s.path) is not (s.order == "F")]
    copies = sum(s.size for s in copied) * itemsize
    # The two-rank exchange flattens what it sends, and of a flat bucket what
    # this rank adds to it too; an owner's own arrays stay shaped.
    sides = [(layout.held_range(bucket, s, 1 - rank) is not None)
             + (not bucket.owned and layout.held_range(bucket, s, rank) is not None)
             for s in copied] if world_size == 2 else []
    exchanged = sum(n * s.size for n, s in zip(sides, copied)) * itemsize
    # Copied out of the gathered vector, the new arrays have buffers of their own.
    apart = not bucket.summed(world_size) and layout.copies_out(bucket, world_size)
    whole = sum(s.size for s in bucket.slots) * param_dtype.size
    elsewhere = whole - sum(a.size for a in mine.values()) * param_dtype.size \
        if bucket.owned and (apart or not mine) else 0
    if bucket.summed(world_size):
        size = summed.elements(bucket)
        # The gather's input: this rank's arrays and -0.0 for the others'
        # (none beyond the array itself where it owns them all).
        sent = 0 if held == size * itemsize else size * param_dtype.size
        return BucketBytes(vector=size * itemsize, shard=held, held=held, packed=sent,
                           gathered=size * param_dtype.size, summed=True, owned=True,
                           copies=copies, sent_copies=copies,  # never exchanged
                           slots=len(bucket.slots), elsewhere=elsewhere)
    parts = layout.held_parts(bucket, mine, rank)
    zeros = 0 if bucket.by_rows else bucket.padding(world_size) * itemsize
    return BucketBytes(
        vector=bucket.nbytes(world_size), shard=bucket.cols * itemsize,
        held=held,
        packed=layout.join(parts, param_dtype).nbytes if len(parts) > 1 else 0,
        gathered=world_size * bucket.cols * param_dtype.size, owned=bucket.owned,
        copies=copies + zeros, sent_copies=exchanged + zeros,
        padding=bucket.padding(world_size) * param_dtype.size, slots=len(bucket.slots),
        copied=whole if apart else 0,
        elsewhere=elsewhere)


def _fsdp_state(
    optimizer,
    flat_params: Sequence[Tuple[str, mx.array]],
    world_size: int,
    rank: int,
    communication_size: int,
    placement=None,
    master_dtype: Optional[mx.Dtype] = None,
    transposed: Optional[dict] = None,
) -> Dict[str, object]:
    """The arrays rank ``rank`` of ``fsdp_step`` keeps, built lazily.

    The step's own plan and :func:`mlx_fsdp.sharded_state.init_held` (what
    ``ShardedOptimizer.init`` runs): this rank's piece of every flat-placed
    array and the whole of every array it owns, masters of those, and the
    real optimizer initialized on them. Built from shape-only (unevaluated)
    arrays, nothing is allocated: read ``.nbytes``.

    Args:
        optimizer (mlx.optimizers.Optimizer): A fresh optimizer; its state is
            initialized here.
        flat_params (list): ``(path, array)`` of every trainable parameter, in
            tree order.
        world_size (int): Ranks in the shard group.
        rank (int): The rank to describe.
        communication_size (int): The bucket byte budget.
        placement (optional): As ``fsdp_step``'s ``placement``. Default: ``None``.
        master_dtype (Dtype, optional): As ``fsdp_step``'s. Default: ``None``.
        transposed (dict, optional): ``{path: bool}``: how each gradient
            arrives, where known (see :func:`bucket_bytes`). Default: ``None``.

    Returns:
        dict: ``"optimizer"``: the optimizer's state tree (as
        ``opt.state["optimizer"]`` after a step); ``"master"``: ``{path:
        master piece}``; ``"gradient"``: ``{path: what this rank holds of the
        reduced gradient}`` (what sharded accumulation keeps; the updated
        pieces, in the parameters' dtype, are as large); ``"buckets"``: the
        :class:`BucketBytes` of every bucket, in plan order; ``"paths"``: the
        paths this rank updates, bucket by bucket.
    """
    if world_size == 1:  # fsdp_step is the plain optimizer then
        return dict(plain_state(optimizer, flat_params, master_dtype),
                    gradient=dict(flat_params), buckets=[], paths=[])
    masters = {}
    arrays = [a for _, a in flat_params]
    plan = plan_for(list(flat_params), arrays, optimizer, world_size, communication_size,
                    placement)
    init_held(plan, optimizer, arrays, rank, masters, master_dtype)
    held = [layout.held_of(b, arrays, rank) for b in plan.buckets]
    gradient = {s.path: a for pairs in held for s, a in pairs}
    buckets: List[BucketBytes] = [bucket_bytes(b, arrays, world_size, rank, transposed)
                                  for b in plan.buckets]
    return {"optimizer": optimizer.state, "master": masters, "gradient": gradient,
            "buckets": buckets, "paths": [[s.path for s, _ in pairs] for pairs in held]}
