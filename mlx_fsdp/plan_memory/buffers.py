"""What a step keeps alive besides the model state: its communication and new parameters.

Both wrappers build one lazy graph per step, which the caller evaluates. MLX
orders a graph breadth-first from its outputs (at most ``MLX_BFS_MAX_WIDTH``,
20, arrays wide) and runs that order backwards (``eval_impl`` in
``mlx/transforms.cpp``), so each operation runs as late as its consumers
allow: one whose only consumer is an update runs just before that update,
however early its input was computed. That decides what is alive at a
step's fullest phase:

**FSDP** (``fsdp_step``, :mod:`mlx_fsdp.step`): the reduce-scatters run
first, one bucket after the other (chained, last bucket first), and the
updates and all-gathers after them, bucket by bucket. What a rank keeps of
a bucket's reduce-scatter (the sums of its own and the received half under
``exchange``, a copy of its shard of an ``all_sum``, the shard a native
``sum_scatter`` returns) is computed before the next bucket's collective
starts, which frees the rest, and lives until that bucket's update. Two
phases can be the fullest:

* **reducing** a bucket: what every other bucket keeps, plus this bucket's
  input and output (under ``exchange`` the half sent and the whole vector
  its all-gather returns; under ``all_sum`` the vector alone, which the
  all-sum overwrites, as MLX's all-sum does with an input nothing else
  holds; the vector and the shard with a native reduce-scatter), and, on
  an unpaced CPU (``pace.QUEUE_DEPTH`` 0), those of the buckets after it
  that MLX's run-ahead reaches;
* **gathering** the fullest bucket: what every bucket keeps, plus the
  bucket's **updated pieces**, the **shard** they are packed into for the
  all-gather (none where the shard is one piece) and the **gathered
  vector**, whose views are the new parameters (where a quarter or more of
  it is padding, copies of its arrays, made before the next gather).

The buckets gathered before it replaced their old parameters, which their
updates released, so the **new parameters** count one bucket's gathered
vector, not a second copy of the model. The division by ``N`` and the
optimizer's arithmetic make copies of one array at a time, left out with
the optimizer's temporaries.

**DDP** (``ddp_step``: ``mlx.nn.average_gradients`` then the plain
optimizer): every group of gradients is concatenated, all-summed in place
and divided in place, and the arrays are views of it until their update, so
the averaged gradients (as large as the gradients) are alive when the
updates start. Before, while a group is packed, the copies that flatten its
transposed gradients (a ``Linear`` weight's gradient is a transposed view)
are alive too: counted as the largest group, and on the CPU as the groups
packed while one is all-summed (:func:`ddp_buffers`). The updates then replace the
old parameters array by array, so the new parameters count one array. One
process (``N = 1``) has neither the averaging nor the buckets.

The optimizer's arithmetic temporaries, and what MLX keeps alive beyond
these buffers because it runs up to 20 independent operations side by side
and, on the CPU, allocates each output when it queues the kernel, are not
counted here but in :mod:`mlx_fsdp.plan_memory.transient`; the margin
measured against ``mx.get_peak_memory`` is in docs/memory-planner.md.
"""

from typing import NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx

from ..options import DEFAULT_SIZE_CPU, DEFAULT_SIZE_GPU
from .sharding import BucketBytes

#: Reduce-scatters (as :func:`mlx_fsdp.collectives.reduce_scatter_method`
#: names them), and ``None``: what ring and MPI get (``exchange`` at N=2,
#: ``all_sum`` above).
REDUCE_SCATTERS = (None, "native", "exchange", "all_sum")

DEVICES = ("cpu", "gpu")

#: Backend -> the reduce-scatter ``fsdp_step`` and ``fully_shard`` run there
#: (see :mod:`mlx_fsdp.collectives`): NCCL and JACCL have a native one.
BACKENDS = {"ring": None, "mpi": None, "nccl": "native", "jaccl": "native"}


def default_device() -> str:
    """``"gpu"`` or ``"cpu"``: the device MLX defaults to on this machine."""
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def default_communication_size(mode: str, device: str) -> int:
    """The bucket budget a wrapper uses when ``communication_size`` is left out.

    ``fsdp_step`` and ``fully_shard``: :data:`mlx_fsdp.options.DEFAULT_SIZE_GPU`
    on a GPU, :data:`~mlx_fsdp.options.DEFAULT_SIZE_CPU` on the CPU;
    ``ddp_step``: MLX's 32 MiB everywhere.
    """
    if device not in DEVICES:
        raise ValueError(f"device={device!r} must be one of {', '.join(DEVICES)}.")
    return DEFAULT_SIZE_CPU if mode != "ddp" and device == "cpu" else DEFAULT_SIZE_GPU


def resolve_reduce_scatter(method: Optional[str], world_size: int) -> str:
    """The reduce-scatter ``fsdp_step`` runs at ``world_size`` ranks (:data:`REDUCE_SCATTERS`)."""
    if method not in REDUCE_SCATTERS:
        raise ValueError(
            f"reduce_scatter={method!r} must be one of {', '.join(map(repr, REDUCE_SCATTERS))} "
            "(None: ring and MPI, exchange at N=2 and all_sum above)."
        )
    if method == "exchange" and world_size != 2:
        raise ValueError(f"reduce_scatter='exchange' needs 2 ranks, not {world_size}; "
                         "use None or 'all_sum'.")
    return method or ("exchange" if world_size == 2 else "all_sum")


def reduce_buffers(bucket: BucketBytes, method: str) -> int:
    """The input and output buffers of one bucket's reduce-scatter, in bytes.

    The vector and the shard (``native``); the peer's half, packed, and the
    whole vector the exchange's all-gather returns (``exchange``: one
    array's half alone is sent as it is, a view); or the vector
    (``all_sum``): MLX's all-sum writes into its input where nothing else
    holds it (``AllReduce::eval_cpu``), as nothing does the packed vector (a
    lone array's vector is its gradient, and there the output is new). At
    MPI N=4 (``bench_fsdp_phases.py --hidden 256``, 2026-11-27) the MLP 4 x
    256's step with SGD peaked at 3.51 MiB, 1.25 MiB above its parameters,
    gradients and state: one vector and the copy of the shard. At ring N=2
    with 2 MiB buckets (2026-11-28) the MLP 4 x 512's step with SGD held its
    four buckets' vectors, sent halves and sums at once: 18.04 MiB, against
    16.09 counted without the sent halves. Beside them, what packing copies
    (:attr:`~mlx_fsdp.plan_memory.sharding.BucketBytes.copies`): at MPI N=4
    (2026-11-28) the step with Adafactor on mlx-lm's Llama 8 x 128, its
    matrices in two owner buckets, held both vectors, their padding's zeros,
    the copies of its transposed weight gradients and a shard: 26.31 MiB,
    against 22.19 counted without the copies, the zeros and the padding the
    parameters keep (``BucketBytes.padding``).
    """
    if bucket.summed:  # its vector and their all-sum (mlx_fsdp.summed), both:
        return 2 * bucket.vector + bucket.copies  # not measured apart since the donation
    if method == "native":
        return bucket.vector + bucket.shard + bucket.copies
    if method == "exchange":
        sent = bucket.shard if bucket.slots > 1 or bucket.padding else 0
        return bucket.vector + sent + bucket.sent_copies
    return bucket.vector + bucket.copies


def fsdp_phases(buckets: Sequence[BucketBytes], method: str,
                ahead: int = 1, index: Optional[int] = None) -> Tuple[int, int, int]:
    """``(reducing, updating, gathered)``: one FSDP rank's buffers in its two phases.

    ``reducing``: what every other bucket keeps, plus the reduce-scatter
    buffers of the ``ahead`` consecutive buckets that hold the most (the
    largest bucket's with ``ahead=1``). ``updating``: what every bucket
    keeps, the copies the division by ``N`` makes of it, and the gathered
    bucket's updated pieces and packed shard; ``gathered``: that bucket's
    all-gathered vector. The gathered bucket is ``buckets[index]``; by
    default, the fullest (:func:`fullest_gather`). ``(0, 0, 0)`` without buckets.
    """
    if not buckets:
        return 0, 0, 0
    # Only what a rank keeps of an output keeps it alive: none of an owner
    # bucket whose arrays are all another rank's.
    mine = [b for b in buckets if b.held]
    kept = {id(b): b.held if method == "exchange" else b.shard for b in mine}
    reduced = sum(kept.values())
    # While a bucket is reduced: its buffers and those allocated ahead of it,
    # next to what the others keep; every rank packs and reduces every
    # bucket, an owner bucket whose arrays are all another rank's too.
    sizes = [reduce_buffers(b, method) for b in buckets]
    reducing = reduced + max((sum(sizes[i:i + ahead])
                              for i in range(max(1, len(sizes) - ahead + 1))), default=0)
    fullest = fullest_gather(buckets) if index is None else buckets[index]
    divided = sum(b.held for b in mine)
    # The copies of the bucket gathered before it (the largest other's), too:
    # the gather waits for them (mlx_fsdp.bucketed), and they met the next
    # one's (the MLP 3 x 1024 with Adafactor at ring N=2: 88.08 MiB, 84.27
    # counted without).
    before = max((b.copied for b in buckets if b is not fullest), default=0)
    return (reducing, reduced + divided + fullest.held + fullest.packed,
            fullest.new_parameters + before)


def fullest_gather(buckets: Sequence[BucketBytes]) -> BucketBytes:
    """The bucket whose gather holds the most: updated pieces, packed shard, gathered vector."""
    return buckets[fullest_index(buckets)]


def fullest_index(buckets: Sequence[BucketBytes]) -> int:
    """The index of :func:`fullest_gather`'s bucket (the first of equals)."""
    return max(range(len(buckets)), key=lambda i: (buckets[i].held + buckets[i].packed
                                                    + buckets[i].new_parameters, -i))


def fsdp_buffer_phases(buckets: Sequence[BucketBytes], method: str, ahead: int = 1,
                       index: Optional[int] = None) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """``(reducing, gathering)`` of one FSDP rank (see the module docstring).

    Each phase of :func:`fsdp_phases` alone, as ``(communication, new
    parameters)``: ``(reducing, 0)`` and ``(gathering, gathered)``, without
    the division's copies (which live next to the optimizer's temporaries;
    :func:`mlx_fsdp.plan_memory.phases.fsdp_fullest` weighs the two).

    Args:
        buckets (list[BucketBytes]): The rank's bytes of every bucket.
        method (str): ``"native"``, ``"exchange"`` or ``"all_sum"``.
        ahead (int): Consecutive buckets whose reduce-scatter buffers are
            alive at once (:func:`mlx_fsdp.plan_memory.phases.reduces_ahead`).
            Default: ``1``.
        index (int, optional): The gathered bucket. Default: ``None``, the
            fullest (:func:`fullest_gather`).

    Returns:
        tuple: Bytes; ``((0, 0), (0, 0))`` without buckets.
    """
    if not buckets:
        return (0, 0), (0, 0)
    reducing, updating, gathered = fsdp_phases(buckets, method, ahead, index)
    return (reducing, 0), (updating - sum(b.held for b in buckets if b.held), gathered)


#: What a gradient's buffer can hold beyond its bytes, at most, per array:
#: MLX's backward pass writes some gradients into a larger buffer and
#: returns a view of it, which keeps the whole buffer alive. Measured (mlx
#: 0.32.4, CPU, 2026-11-29) on mlx-lm's Llama: a 48 x 96 key or value
#: projection's gradient held 64 x 96 (6 KiB more), RMSNorm weights' up to
#: 67% more than their bytes (160 elements held 256, 384 held 640), the 256 x
#: 128 embedding's 8 rows more. 16 blocks of 96 held 196 KiB beyond their
#: gradients' bytes, 64 blocks 700 KiB: above ``ddp_step``'s plan, whose
#: packing phase has the least room. Counted as each gradient's bytes again,
#: up to this.
VIEW_SLACK = 8 * 1024


def view_slack(gradients: Sequence[mx.array]) -> int:
    """What the caller's ``gradients`` can hold beyond their bytes, in every
    phase of a step that leaves them to the caller (:data:`VIEW_SLACK`)."""
    return sum(min(g.nbytes, VIEW_SLACK) for g in gradients)


class DdpBuffers(NamedTuple):
    """One DDP rank's buffers, in bytes (see the module docstring)."""

    averaged: int  #: the averaged gradients: every group's vector, all-summed in place
    packing: int  #: the copies of the groups packed at once (:func:`ddp_buffers`)
    new_parameters: int  #: the largest array's new value
    groups: int  #: groups ``average_gradients`` packs (0: it all-sums array by array)
    views: int  #: what the gradients' buffers hold beyond their bytes (:data:`VIEW_SLACK`)


#: Operations ``mlx.nn.average_gradients`` makes of a group, beyond two per
#: array (its flattening and its view of the result): the concatenation, the
#: all-sum, the division and its divisor, the split (``mx.export_to_dot``,
#: mlx 0.32.4).
GROUP_OPS = 4


def ddp_buffers(gradients: Sequence[mx.array], world_size: int,
                communication_size: int, window: int = 0) -> DdpBuffers:
    """:class:`DdpBuffers` of one DDP rank.

    While a group is all-summed the main thread queues the next groups'
    packing, allocating their copies: ``window`` bounds it, in operations
    (the CPU's :data:`~mlx_fsdp.plan_memory.transient.IN_FLIGHT_OPS`). At
    MPI N=3 and 4 the MLP 4 x 256 with SGD in groups of 256 KiB (five, of a
    weight, or a bias and a weight) peaked at 5.77 MiB, 5.56 counted with
    the largest group's copies alone (2026-11-29).

    Args:
        gradients (list[array]): The gradients, in tree order.
        world_size (int): Ranks.
        communication_size (int): ``average_gradients``' group size in bytes.
        window (int): Operations queued ahead of the worker whose groups'
            copies are counted together (at least one group's). Default:
            ``0``, the largest group's alone.

    Returns:
        DdpBuffers: Bytes; one process averages nothing.
    """
    largest = max(g.nbytes for g in gradients)
    views = view_slack(gradients)
    if world_size == 1:
        return DdpBuffers(0, 0, largest, 0, views)
    grads = sum(g.nbytes for g in gradients)
    sizes, ops, used = [], [], 0  # per group: its bytes and operations
    if communication_size > 0 and len({g.dtype for g in gradients}) == 1:
        for g in gradients:  # average_gradients closes a group once it reaches the size
            if used == 0:
                sizes.append(0)
                ops.append(GROUP_OPS)
            sizes[-1] += g.nbytes
            ops[-1] += 2
            used += g.nbytes
            used = 0 if used >= communication_size else used
    packing = 0
    for start in range(len(sizes)):
        end, queued = start + 1, ops[start]
        while end < len(sizes) and queued + ops[end] <= window:
            queued += ops[end]
            end += 1
        packing = max(packing, sum(sizes[start:end]))
    return DdpBuffers(grads, packing, largest, len(sizes), views)
