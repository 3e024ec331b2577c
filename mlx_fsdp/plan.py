"""The sharding plan: which arrays share a bucket and which rank holds what.

A plan is pure data derived from the gradient tree's paths, shapes and dtypes,
the sub-optimizer and placement of every array, the world size and the byte
budget. Every rank builds the same plan, so it can be compared across ranks
with a fingerprint, printed, and written into checkpoints.

Layout. A bucket is one flat vector of ``N * cols`` elements: its arrays,
flattened, one after the other, then zero padding. Rank ``r`` holds elements
``[r * cols, (r + 1) * cols)``: its *shard*. Reduce-scattering the bucket
leaves each rank its shard of the summed gradients; all-gathering the updated
shards gives the whole vector back, in which every array is one contiguous
slice, so the new parameters are views of the gathered buffer with no copy.

* A *flat* bucket (element-wise optimizers) packs its arrays back to back and
  pads at the end: an array may straddle two ranks' shards, and every rank
  holds about ``1/N`` of the bucket (see :mod:`mlx_fsdp.flat`).
* An *owner* bucket (shape-aware optimizers: Muon, Adafactor) gives every
  array to one owner rank (see :mod:`mlx_fsdp.owners`) and packs rank ``r``'s
  arrays at the start of its shard, padded to the longest shard: the owner
  gets each of its arrays whole and updates it with the unmodified optimizer
  (one more than half padding is all-summed without it, :mod:`mlx_fsdp.summed`).
* A *rows* bucket (the parameters :func:`mlx_fsdp.fully_shard` keeps) gives
  every rank its axis-0 slice of every array, each padded to the same number
  of rows (see :mod:`mlx_fsdp.rows`).
"""

import functools
import hashlib
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

import mlx.core as mx

from . import flat as _flat
from . import owners as _owners
from . import rows as _rows

#: Placements: 1/N of a bucket per rank, whole arrays on owner ranks (see
#: :mod:`mlx_fsdp.placement`), or every rank its axis-0 slice (see :mod:`mlx_fsdp.rows`).
FLAT, OWNER, ROWS = "flat", "owner", "rows"


def dtype_name(dtype: mx.Dtype) -> str:
    """The short name of an MLX dtype, e.g. ``"bfloat16"``."""
    return str(dtype).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Slot:
    """One array's place in its bucket's flat vector.

    Attributes:
        path (str): The array's path in the tree, as ``tree_flatten`` names it.
        index (int): The array's position in the flattened gradient tree.
        shape (tuple): The array's full shape.
        size (int): Number of elements.
        start (int): Its first element in the bucket's flat vector.
        owner (int, optional): For an owner bucket, the rank that holds and
            updates the whole array; ``None`` in a flat bucket.
        order (str): ``"F"`` if the array is enumerated column by column,
            ``"C"`` if row by row (see :mod:`mlx_fsdp.flat`); in a rows
            bucket, ``"F"`` enumerates each rank's rows column by column, a
            gradient plan's order only (see :mod:`mlx_fsdp.columns`).
        rows (int): In a rows bucket, the rows of each rank's chunk, and
            ``start`` is where the chunk starts in every shard; ``0`` otherwise.
    """

    path: str
    index: int
    shape: Tuple[int, ...]
    size: int
    start: int
    owner: Optional[int] = None
    order: str = "C"
    rows: int = 0

    @property
    def stop(self) -> int:
        return self.start + self.size


@dataclass(frozen=True)
class Bucket:
    """Arrays reduced, updated and gathered together.

    Attributes:
        index (int): The bucket's position in the plan.
        dtype (str): The gradients' dtype, which is also the reduce dtype.
        param_dtype (str): The parameters' dtype, which the all-gather moves.
        optimizer (int): Index of the sub-optimizer that updates it (0 unless
            the optimizer is a ``MultiOptimizer``).
        owned (bool): Whether arrays are kept whole on owner ranks.
        slots (tuple[Slot]): The arrays, in their order in the flat vector.
        cols (int): Elements of each rank's shard.
        by_rows (bool): Whether every rank holds its axis-0 slice of every array.
        sharded_params (bool): Whether the model itself keeps only what each
            rank holds of these parameters (:func:`mlx_fsdp.fully_shard`), so
            that the step neither reduce-scatters nor all-gathers the bucket.
    """

    index: int
    dtype: str
    param_dtype: str
    optimizer: int
    owned: bool
    slots: Tuple[Slot, ...]
    cols: int
    by_rows: bool = False
    sharded_params: bool = False

    @property
    def key(self) -> str:
        """The bucket's name in the optimizer state: ``"b<index>"``."""
        return f"b{self.index}"

    def shard(self, rank: int) -> Tuple[int, int]:
        """``[start, stop)`` of ``rank``'s shard in the flat vector."""
        return rank * self.cols, (rank + 1) * self.cols

    def held(self, rank: int) -> Tuple[Slot, ...]:
        """The slots with elements in ``rank``'s shard (owner buckets: those it owns)."""
        if self.by_rows:
            return tuple(s for s in self.slots if s.size and _rows.holds(s.shape, s.rows, rank))
        lo, hi = self.shard(rank)
        return tuple(s for s in self.slots if s.start < hi and s.stop > lo)

    def padding(self, world_size: int) -> int:
        """Zeros in the flat vector."""
        return world_size * self.cols - sum(s.size for s in self.slots)

    def summed(self, world_size: int) -> bool:
        """Whether it is all-summed unpadded (:mod:`mlx_fsdp.summed`): owned, over half padding."""
        return self.owned and 2 * self.padding(world_size) > world_size * self.cols

    def nbytes(self, world_size: int) -> int:
        """Bytes of the flat vector in the reduce dtype, padding included."""
        return world_size * self.cols * getattr(mx, self.dtype).size


@dataclass(frozen=True)
class Plan:
    """How a gradient tree is bucketed and sharded over ``world_size`` ranks.

    Attributes:
        world_size (int): Number of ranks the buckets are split over.
        communication_size (int): The byte budget of a bucket.
        buckets (tuple[Bucket]): The buckets, in tree order.
    """

    world_size: int
    communication_size: int
    buckets: Tuple[Bucket, ...]

    @property
    def num_arrays(self) -> int:
        return sum(len(b.slots) for b in self.buckets)

    @property
    def num_elements(self) -> int:
        return sum(s.size for b in self.buckets for s in b.slots)

    @property
    def num_padding(self) -> int:
        """Zeros added in all, over all ranks."""
        return sum(b.padding(self.world_size) for b in self.buckets)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hex digest that differs whenever any field of the plan differs."""
        return hashlib.sha256(repr(self).encode()).hexdigest()

    def to_dict(self) -> dict:
        """The plan as plain JSON-able data (what checkpoints store)."""
        return asdict(self)

    def __str__(self):
        if not self.buckets:
            return (f"Plan: {self.world_size} process: the plain optimizer on whole arrays, "
                    "no buckets, no communication")
        lines = [
            f"Plan: {self.num_arrays} arrays, {self.num_elements} elements, "
            f"{len(self.buckets)} buckets, N={self.world_size}, "
            f"budget={self.communication_size} bytes, padding={self.num_padding}"
        ]
        for b in self.buckets:
            kind = ("whole arrays on owner ranks" if b.owned else
                    "axis-0 slices" if b.by_rows else "flat")
            if b.sharded_params:
                kind += " in the model (fully_shard)"
            elif b.summed(self.world_size):
                kind += ", all-summed without the padding"
            lines.append(
                f"  bucket {b.index}: {kind}, {b.dtype} (params {b.param_dtype}), optimizer "
                f"{b.optimizer}, {len(b.slots)} arrays, shard {b.cols} elements, "
                f"{b.nbytes(self.world_size)} bytes, padding {b.padding(self.world_size)}"
            )
            for s in b.slots:
                if b.by_rows:
                    lines.append(f"    {s.path} {s.shape}: {s.rows} rows per rank at {s.start}")
                    continue
                where = (f"rank {s.owner}" if s.owner is not None else
                         f"ranks {s.start // b.cols}-{(s.stop - 1) // b.cols}")
                order = ", column by column" if s.order == "F" else ""
                lines.append(f"    {s.path} {s.shape}: [{s.start}, {s.stop}) on {where}{order}")
        return "\n".join(lines)


#: (path, shape, grad dtype name, param dtype name, optimizer index, placement) per array.
Signature = Tuple[tuple, ...]


def _check_signature(signature: Signature):
    if not signature:
        raise ValueError(
            "The gradient tree is empty: there is nothing to shard. Pass the "
            "gradients of the model's trainable parameters, e.g. from "
            "nn.value_and_grad(model, loss_fn)."
        )
    for path, shape, dtype, param_dtype, *_ in signature:
        for name, what in ((dtype, "gradient"), (param_dtype, "parameter")):
            if not mx.issubdtype(getattr(mx, name), mx.floating):
                raise ValueError(
                    f"The {what} at '{path}' has dtype {name}; sharded updates "
                    "need floating-point arrays. Freeze it (model.freeze(keys=...)) "
                    "or leave it out of the gradient tree."
                )


def _flat_buckets(entries, n, itemsize, budget):
    return [([Slot(p, i, sh, sz, start, order=order) for i, p, sh, sz, start, order in placed], cols)
            for cols, placed in _flat.layout(entries, n, itemsize, budget)]


def _owner_buckets(entries, owner, n, itemsize, budget):
    out = []
    for cols, placed in _owners.layout(entries, owner, n, itemsize, budget):
        slots = [Slot(p, i, tuple(sh), sz, r * cols + off, r) for i, p, sh, sz, r, off in placed]
        out.append((sorted(slots, key=lambda s: s.start), cols))
    return out


def _row_buckets(entries, n, itemsize, budget):
    return [([Slot(p, i, sh, sz, off, rows=k) for i, p, sh, sz, k, off in placed], cols)
            for cols, placed in _rows.layout(entries, n, itemsize, budget)]


@functools.lru_cache(maxsize=64)
def build_plan(signature: Signature, world_size: int, communication_size: int,
               owner_loads: tuple = ()) -> Plan:
    """Build (or fetch from the cache) the plan for a tree signature.

    Arrays are grouped by (sub-optimizer, gradient dtype, parameter dtype,
    placement), in tree order; a bucket is closed before an array that would
    take it past ``communication_size`` bytes, so an array larger than the
    budget gets a bucket of its own. Owner-placed arrays get their owners
    and shard positions from :mod:`mlx_fsdp.owners`, row-placed ones their
    chunks from :mod:`mlx_fsdp.rows`.

    Args:
        signature (tuple): ``(path, shape, grad_dtype, param_dtype, optimizer,
            placement)`` for every array, in tree order (see
            :func:`mlx_fsdp.placement.signature_of`).
        world_size (int): Number of ranks to shard over.
        communication_size (int): Byte budget of a bucket; ``<= 0`` puts every
            array in a bucket of its own.
        owner_loads (tuple, optional): ``(cost, bytes)`` per rank that owner
            placement starts from (see :func:`mlx_fsdp.owners.assign`).
            Default: ``()`` (nothing owned yet).

    Returns:
        Plan: The plan.
    """
    _check_signature(signature)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer.")
    groups = {}
    for index, (path, shape, dtype, param_dtype, optimizer, where) in enumerate(signature):
        groups.setdefault((optimizer, dtype, param_dtype, where), []).append(
            (index, path, tuple(shape)))
    # One balance over all owner-placed arrays: their updates run in the same step.
    owner = _owners.assign(
        [(path, shape, getattr(mx, dtype).size)
         for (_, dtype, _, where), entries in groups.items() if where == OWNER
         for _, path, shape in entries],
        world_size, owner_loads,
    )
    buckets = []
    for (optimizer, dtype, param_dtype, where), entries in groups.items():
        itemsize = getattr(mx, dtype).size
        if where == OWNER:
            split = _owner_buckets(entries, owner, world_size, itemsize, communication_size)
        elif where == ROWS:
            split = _row_buckets(entries, world_size, itemsize, communication_size)
        else:
            split = _flat_buckets(entries, world_size, itemsize, communication_size)
        for slots, cols in split:
            buckets.append(Bucket(len(buckets), dtype, param_dtype, optimizer, where == OWNER,
                                  tuple(slots), cols, where == ROWS))
    return Plan(world_size, int(communication_size), tuple(buckets))
