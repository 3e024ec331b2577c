"""The sharding plan: which arrays share a bucket and where each one lives.

A plan is pure data derived from the gradient tree's paths, shapes and dtypes,
the world size and the byte budget. Every rank builds the same plan, so it can
be compared across ranks with one small collective, printed, and (later)
written into checkpoints.

Layout. Every array of ``size`` elements is viewed as ``(N, cols)`` with
``cols = ceil(size / N)``, zero-padded at the end when ``size`` does not
divide by ``N``. A bucket concatenates its arrays along axis 1, so row ``r``
of a bucket is rank ``r``'s shard: a contiguous ``cols``-long piece of every
array in it.

Element order. A sharded 2-D array is enumerated column by column (its
transpose's row-major order, ``Slot.order == "F"``); every other array row by
row. MLX returns the gradient of a ``Linear`` weight, ``x @ W.T``, as a
transposed view of a row-major ``(in, out)`` array, so in column order its
pieces are plain slices, where row order needs a strided copy of the whole
gradient every step (about 4.5 ms per 4 MiB matrix on the development
machine, a quarter of the step's update side for a 4.2M MLP). The gathered
parameter is then a transposed view too, so its own pieces are slices from
the second step on. The order is fixed by the plan, not by the memory layout
an array happens to have, so results do not depend on it: an array stored
row by row (an embedding table's gradient) pays the copy instead.

Arrays placed on owners (see :mod:`mlx_fsdp.owners`) are kept whole instead:
an owner bucket's row ``r`` holds the whole arrays rank ``r`` owns. Flat and
owner arrays never share a bucket.
"""

import functools
import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import mlx.core as mx

from . import owners as _owners

#: Arrays of at least this many packed bytes get a bucket of their own.
#: Sharing a collective only saves latency, which is negligible next to the
#: transfer time of a megabyte, while a lone array needs no packing or
#: unpacking copies: measured on ring N=2, this took the step's peak memory
#: from 6.0 to ~4.5 times the parameter bytes (4x1024^2 MLP, one 32 MiB bucket).
SOLO_BYTES = 1 << 20


def dtype_name(dtype: mx.Dtype) -> str:
    """The short name of an MLX dtype, e.g. ``"bfloat16"``."""
    return str(dtype).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Slot:
    """One array's place in a bucket.

    Attributes:
        path (str): The array's path in the tree, as ``tree_flatten`` names it.
        index (int): The array's position in the flattened gradient tree.
        shape (tuple): The array's full shape.
        size (int): Number of elements.
        cols (int): Elements of this array on each rank: ``ceil(size / N)``
            for a flat array, ``size`` for an owned one.
        offset (int): First column of this array in the bucket's shard (in
            its owner's row for an owned array).
        owner (int, optional): ``None`` for the flat layout; otherwise the
            rank that holds and updates the whole array, in columns
            ``[offset, offset + size)`` of that rank's row.
        order (str): ``"F"`` if the flat layout enumerates the array column by
            column (a 2-D array sharded over more than one rank), ``"C"`` if
            row by row. See the module docstring.
    """

    path: str
    index: int
    shape: Tuple[int, ...]
    size: int
    cols: int
    offset: int
    owner: Optional[int] = None
    order: str = "C"


@dataclass(frozen=True)
class Bucket:
    """Arrays reduced, updated and gathered together.

    Attributes:
        dtype (str): The gradients' dtype, which is also the communication dtype.
        param_dtype (str): The parameters' dtype.
        optimizer (int): Index of the sub-optimizer that updates this bucket
            (always 0 unless the optimizer is a ``MultiOptimizer``).
        slots (tuple[Slot]): The arrays, in tree order.
        cols (int): Length of each rank's shard of the bucket.
    """

    dtype: str
    param_dtype: str
    optimizer: int
    slots: Tuple[Slot, ...]
    cols: int

    @property
    def owned(self) -> bool:
        """Whether the bucket holds whole arrays on owner ranks (not flat pieces)."""
        return self.slots[0].owner is not None

    def padding(self, world_size: int) -> int:
        """Zeros in the packed ``(N, cols)`` bucket."""
        return world_size * self.cols - sum(s.size for s in self.slots)

    def nbytes(self, world_size: int) -> int:
        """Bytes of the packed ``(N, cols)`` bucket, padding included."""
        return world_size * self.cols * getattr(mx, self.dtype).size


@dataclass(frozen=True)
class Plan:
    """How a gradient tree is bucketed and sharded over ``world_size`` ranks.

    Attributes:
        world_size (int): Number of ranks the arrays are split over.
        communication_size (int): The byte budget of a bucket.
        buckets (tuple[Bucket]): The buckets, in the order they are reduced.
    """

    world_size: int
    communication_size: int
    buckets: Tuple[Bucket, ...]

    @property
    def num_arrays(self) -> int:
        return sum(len(b.slots) for b in self.buckets)

    @property
    def has_owners(self) -> bool:
        """Whether any array is kept whole on an owner rank."""
        return any(b.owned for b in self.buckets)

    @property
    def num_elements(self) -> int:
        return sum(s.size for b in self.buckets for s in b.slots)

    @property
    def num_padding(self) -> int:
        """Zeros added in all, over all ranks."""
        return sum(b.padding(self.world_size) for b in self.buckets)

    def fingerprint(self) -> str:
        """A hex digest that differs whenever any field of the plan differs."""
        return hashlib.sha256(repr(self).encode()).hexdigest()

    def __str__(self):
        lines = [
            f"Plan: {self.num_arrays} arrays, {self.num_elements} elements, "
            f"{len(self.buckets)} buckets, N={self.world_size}, "
            f"budget={self.communication_size} bytes, padding={self.num_padding}"
        ]
        for i, b in enumerate(self.buckets):
            lines.append(
                f"  bucket {i}: {b.dtype} (params {b.param_dtype}), optimizer "
                f"{b.optimizer}, {len(b.slots)} arrays, shard {b.cols} elements, "
                f"{b.nbytes(self.world_size)} bytes packed"
                + (f", whole arrays on owners, padding {b.padding(self.world_size)}" if b.owned else "")
            )
            for s in b.slots:
                if s.owner is not None:
                    where = f"rank {s.owner} cols [{s.offset}, {s.offset + s.size})"
                else:
                    where = (f"cols [{s.offset}, {s.offset + s.cols}), padding "
                             f"{self.world_size * s.cols - s.size}"
                             + (", column by column" if s.order == "F" else ""))
                lines.append(f"    {s.path} {s.shape}: {where}")
        return "\n".join(lines)


#: (path, shape, grad dtype name, param dtype name, optimizer index[, placement])
#: per array; placement is "flat" (the default when left out) or "owner".
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


@functools.lru_cache(maxsize=64)
def build_plan(signature: Signature, world_size: int, communication_size: int) -> Plan:
    """Build (or fetch from the cache) the plan for a tree signature.

    Arrays are grouped by (sub-optimizer, gradient dtype, parameter dtype,
    placement), in tree order; a bucket is closed before an array that would
    take it past ``communication_size`` bytes, so an array larger than the
    budget gets a bucket of its own. So does every flat-placed array of at
    least :data:`SOLO_BYTES` (1 MiB): bucketing pays off for small arrays,
    whose collectives would be dominated by latency, while a large array
    alone needs no copies to be packed and unpacked. Owner-placed arrays get
    their owners and bucket rows from :mod:`mlx_fsdp.owners`.

    Args:
        signature (tuple): ``(path, shape, grad_dtype, param_dtype, optimizer
            [, placement])`` for every array, in tree order. See
            :func:`signature_of`.
        world_size (int): Number of ranks to shard over.
        communication_size (int): Byte budget of a bucket; ``<= 0`` puts every
            array in a bucket of its own.

    Returns:
        Plan: The plan.
    """
    _check_signature(signature)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer.")

    groups = {}
    for index, (path, shape, dtype, param_dtype, optimizer, *rest) in enumerate(signature):
        owned = bool(rest) and rest[0] == "owner"
        groups.setdefault((optimizer, dtype, param_dtype, owned), []).append((index, path, shape))
    # One balance over all owned arrays: their updates all run in the same step.
    owned_arrays = [
        (path, tuple(shape), getattr(mx, dtype).size)
        for (_, dtype, _, owned), entries in groups.items()
        if owned
        for _, path, shape in entries
    ]
    owner = _owners.assign(owned_arrays, world_size)

    buckets = []
    for (optimizer, dtype, param_dtype, owned), entries in groups.items():
        itemsize = getattr(mx, dtype).size
        if owned:
            for cols, slots in _owners.layout(
                entries, owner, world_size, itemsize, communication_size
            ):
                buckets.append(
                    Bucket(dtype, param_dtype, optimizer,
                           tuple(Slot(p, i, sh, sz, sz, off, r) for i, p, sh, sz, r, off in slots),
                           cols)
                )
            continue
        current, used = [], 0
        for index, path, shape in entries:
            size = 1
            for d in shape:
                size *= d
            cols = -(-size // world_size)
            nbytes = world_size * cols * itemsize
            entry = (path, index, tuple(shape), size, cols)
            if nbytes >= SOLO_BYTES:
                buckets.append(_close(dtype, param_dtype, optimizer, [entry], world_size))
                continue
            if current and (communication_size <= 0 or used + nbytes > communication_size):
                buckets.append(_close(dtype, param_dtype, optimizer, current, world_size))
                current, used = [], 0
            current.append(entry)
            used += nbytes
        if current:
            buckets.append(_close(dtype, param_dtype, optimizer, current, world_size))
    return Plan(world_size, int(communication_size), tuple(buckets))


def _close(dtype, param_dtype, optimizer, entries, world_size) -> Bucket:
    slots, offset = [], 0
    for path, index, shape, size, cols in entries:
        order = "F" if len(shape) == 2 and world_size > 1 else "C"
        slots.append(Slot(path, index, shape, size, cols, offset, order=order))
        offset += cols
    return Bucket(dtype, param_dtype, optimizer, tuple(slots), offset)


def signature_of(
    flat_grads: Sequence[Tuple[str, mx.array]],
    flat_params: Sequence[mx.array],
    optimizer_of: Sequence[int] = None,
    placement_of: Sequence[str] = None,
) -> Signature:
    """The hashable description of a flat gradient tree that a plan is built from.

    Args:
        flat_grads (list): ``(path, gradient)`` pairs from ``tree_flatten``.
        flat_params (list): The matching parameters, in the same order.
        optimizer_of (list[int], optional): Sub-optimizer index of each array.
            Default: all ``0``.
        placement_of (list[str], optional): ``"flat"`` or ``"owner"`` for each
            array. Default: all ``"flat"``.

    Returns:
        tuple: The signature.
    """
    optimizer_of = optimizer_of or [0] * len(flat_grads)
    placement_of = placement_of or ["flat"] * len(flat_grads)
    return tuple(
        (path, tuple(g.shape), dtype_name(g.dtype), dtype_name(p.dtype), o, where)
        for (path, g), p, o, where in zip(flat_grads, flat_params, optimizer_of, placement_of)
    )
