"""What an eager ``fsdp_step`` has freed by the time it gathers a bucket.

The gathers run in plan order, each after the one before (:mod:`mlx_fsdp.step`),
so when bucket ``i`` is gathered every bucket before it has been updated and
gathered: their reduced pieces, and the division's copies of them, are gone.
And where arrays are kept whole on owner ranks (Muon's and Adafactor's
matrices), a rank never reads the old value of an array another rank updates:
once the training loop hands the model its new parameters, nothing holds the
old one, and the rank has none of it until its bucket is gathered. That holds
where the old array has a buffer of its own: copied out of a padded bucket
(:func:`mlx_fsdp.layout.copies_out`), or cut from a vector none of whose
arrays this rank updates. Otherwise the views of this rank's own arrays keep
the whole vector alive.

Measured (ring N=2, the 2-core CPU, mlx 0.32.4, 2026-11-30): on mlx-lm's
Llama 2 x 768 with Adafactor, whose matrices are each alone in an owner
bucket, half of it padding, the step peaked at 180.50 MiB, and at 220.64 MiB
with the loop holding the old parameters; on the MLP 3 x 1024, handing the
model its new parameters freed the 4 MiB matrix the other rank updates
before anything ran. The MLP 4 x 256 at MPI N=4, whose four matrices share
one bucket, freed it at the first step only, and peaked at 4.77 MiB either
way.

:func:`mlx_fsdp.plan_memory.phases.fsdp_fullest` takes :class:`Freed` off its
gathering phase (the old parameters as ``RankMemory.freed``, the planner's
``freed`` column, negative); a loop that keeps its old parameters
(``keeps_old_parameters``) is counted with all of them on top, as before. A
step compiled whole, and a GPU's, are not counted so (not measured).
"""

from typing import List, NamedTuple, Sequence

from .sharding import BucketBytes
from .transient import Temporaries


class Freed(NamedTuple):
    """Bytes freed before one bucket's gather (see the module docstring)."""

    parameters: int = 0  #: old arrays another rank updates, of this bucket and those after
    reduced: int = 0  #: what the buckets before it kept of their reduce-scatters
    divided: int = 0  #: the division's copies of their pieces


def freed_before(buckets: Sequence[BucketBytes], method: str) -> List[Freed]:
    """:class:`Freed` at each bucket's gather, in plan order; ``method``: the
    reduce-scatter's (what a bucket keeps of it, as
    :func:`~mlx_fsdp.plan_memory.buffers.fsdp_phases` counts it)."""
    out, later, reduced, divided = [], sum(b.elsewhere for b in buckets), 0, 0
    for b in buckets:
        out.append(Freed(later, reduced, divided))
        later -= b.elsewhere
        if b.held:
            reduced += b.held if method == "exchange" else b.shard
            divided += b.held
    return out


def with_room(freed: Freed, others: Temporaries) -> Freed:
    """``freed``, less the room the other buckets' updates queued ahead may take.

    A gather is counted beside the other buckets' updates under way, not
    those queued ahead (:func:`~mlx_fsdp.plan_memory.phases.fsdp_fullest`),
    a count fitted while every old parameter was counted. With the freed
    arrays taken off, the MLP 3 x 1024 with Adafactor at ring N=2 (two of its
    three matrices on rank 0) peaked 3.86 MiB above the plan, 88.08 MiB: the
    queued-ahead updates are counted in the freed arrays' place, up to their
    bytes.
    """
    return freed._replace(parameters=max(0, freed.parameters - (others.together - others.side)))
