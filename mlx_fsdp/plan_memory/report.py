"""The planner's answers: configurations, the search for enough ranks, tables and JSON."""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from . import optimizers
from .estimate import RankMemory, estimate_ranks
from .shapes import Model

GiB = 1024**3
#: World sizes tried, smallest first, when looking for the fewest ranks that fit.
SEARCH = tuple(range(2, 17)) + (24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


@dataclass(frozen=True)
class Row:
    """One configuration's answer.

    Attributes:
        optimizer (str): The optimizer's name.
        mode (str): ``"ddp"`` or ``"fsdp"``.
        world_size (int): Ranks.
        ranks (list[RankMemory]): Every rank (one for DDP).
    """

    optimizer: str
    mode: str
    world_size: int
    ranks: List[RankMemory]

    @property
    def fullest(self) -> RankMemory:
        """The rank with the highest predicted peak (owners make ranks differ)."""
        return max(self.ranks, key=lambda r: r.peak)

    def fits(self, memory: Optional[int]) -> Optional[bool]:
        return None if memory is None else self.fullest.peak <= memory

    def to_dict(self, memory: Optional[int]) -> dict:
        return {
            "optimizer": self.optimizer, "mode": self.mode, "world_size": self.world_size,
            "fullest_rank": self.fullest.to_dict(),
            "optimizer_bytes_by_rank": [r.optimizer for r in self.ranks],
            "fits": self.fits(memory),
        }


def fewest_ranks(model: Model, optimizer: str, memory: int, max_ranks: int,
                 **options) -> Tuple[Optional[int], str]:
    """The smallest world size of 1 and :data:`SEARCH` (up to ``max_ranks``) at which FSDP fits.

    FSDP keeps the whole model and its gradients on every rank, so when
    those alone exceed ``memory`` no world size is tried.

    Returns:
        tuple: The world size (``None`` if none fits) and, if none, why.
    """
    one = estimate_ranks(model, optimizer, "fsdp", 1, **options)[0]
    floor = one.parameters + one.gradients
    if options.get("accumulation") == "local":
        floor += one.accumulation
    if floor > memory:
        return None, (f"parameters and gradients alone take {gib(floor)} "
                      "GiB on every rank, at any N")
    tried = [n for n in (1,) + SEARCH if n <= max_ranks]
    for n in tried:
        if max(r.peak for r in estimate_ranks(model, optimizer, "fsdp", n, **options)) <= memory:
            return n, ""
    return None, (f"at no N tried up to {tried[-1]} (every N to 16, then "
                  f"{', '.join(map(str, tried[16:19]))}, ...)")


def gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f}"


COLUMNS = ("mode", "N", "params", "grads", "accum", "opt state", "masters", "comm",
           "new params", "peak")


def table(rows: Sequence[Row], memory: Optional[int]) -> str:
    """Aligned columns, GiB per rank (the fullest rank), one line per mode and N."""
    header = list(COLUMNS) + ([f"fits {gib(memory)} GiB"] if memory is not None else [])
    lines = [header]
    for row in rows:
        r = row.fullest
        cells = [row.mode, str(row.world_size)] + [
            gib(v) for v in (r.parameters, r.gradients, r.accumulation, r.optimizer,
                             r.masters, r.communication, r.new_parameters, r.peak)
        ]
        if memory is not None:
            cells.append("yes" if row.fits(memory) else "no")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(line, widths))) for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def verdicts(rows: Sequence[Row], memory: Optional[int]) -> List[str]:
    """One line per N: each mode's peak, and whether it fits."""
    out = []
    for n in sorted({r.world_size for r in rows}):
        parts = []
        for row in (r for r in rows if r.world_size == n):
            peak = row.fullest.peak
            fit = "" if memory is None else (" fits" if peak <= memory else " does not fit")
            parts.append(f"{row.mode.upper()} {gib(peak)} GiB{fit}")
        out.append(f"N={n}: " + ", ".join(parts))
    return out


def describe(name: str) -> str:
    return optimizers.OPTIMIZERS[name][0]
