"""The parts of one rank's predicted peak, and the bytes of a shape-only tree."""

from dataclasses import asdict, dataclass, fields

import mlx.core as mx
from mlx.utils import tree_flatten


def tree_bytes(tree) -> int:
    """Bytes of every array in a tree (scalars included), without evaluating."""
    return sum(v.nbytes for _, v in tree_flatten(tree) if isinstance(v, mx.array))


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds (:mod:`mlx_fsdp.plan_memory.estimate` says what each field counts).

    A part alive only in a phase of the step other than the fullest one is 0
    (see :mod:`mlx_fsdp.plan_memory.fully`), so the peak is always the sum.
    """

    parameters: int
    gradients: int
    accumulation: int
    optimizer: int
    masters: int
    communication: int
    new_parameters: int
    gathered: int = 0
    full_gradients: int = 0
    temporaries: int = 0
    activations: int = 0
    #: What is gone by the fullest phase, negative: old parameters another rank
    #: updates whole (:mod:`mlx_fsdp.plan_memory.freed`), and local
    #: accumulation's sums once the reduce-scatters have read them.
    freed: int = 0

    @property
    def peak(self) -> int:
        """Their sum: the predicted peak of one optimizer step."""
        return sum(getattr(self, f.name) for f in fields(self))

    def to_dict(self) -> dict:
        return dict(asdict(self), peak=self.peak)
