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
        mode (str): ``"ddp"``, ``"fsdp"`` or ``"fully_shard"``.
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


#: How the verdicts name each mode.
LABELS = {"ddp": "DDP", "fsdp": "FSDP", "fully_shard": "fully_shard"}


def fewest_ranks(model: Model, optimizer: str, memory: int, max_ranks: int,
                 mode: str = "fsdp", **options) -> Tuple[Optional[int], str]:
    """The smallest world size of 1 and :data:`SEARCH` (up to ``max_ranks``) at which a mode fits.

    FSDP keeps the whole model and its gradients on every rank, and fully
    sharded training gathers the same parameters and full gradients at any
    N, so when those alone exceed ``memory`` no further world size is tried.
    ``options``' ``activations`` may be a callable ``world_size -> bytes``:
    how a pass holds them can depend on N (:func:`~mlx_fsdp.plan_memory.
    activations.pass_of`).

    Returns:
        tuple: The world size (``None`` if none fits) and, if none, why.
    """
    acts = options.pop("activations", 0)
    acts_at = acts if callable(acts) else (lambda n: acts)
    if mode == "fsdp":
        one = estimate_ranks(model, optimizer, "fsdp", 1, activations=acts_at(1), **options)[0]
        floor = one.parameters + one.gradients + one.activations
        parts = ["parameters", "gradients"] + ["activations"] * (one.activations > 0)
        if options.get("accumulation") == "local":
            floor += one.accumulation
            parts.append("accumulated gradients")
        if floor > memory:
            return None, (f"{', '.join(parts[:-1])} and {parts[-1]} alone take {gib(floor)} "
                          "GiB on every rank, at any N")
    tried = [n for n in (1,) + SEARCH if n <= max_ranks]
    for n in tried:
        # Up to the first rank above the memory: the others cannot make it fit.
        ranks = estimate_ranks(model, optimizer, mode, n, activations=acts_at(n),
                               budget=memory, **options)
        if max(r.peak for r in ranks) <= memory:
            return n, ""
        floor = max(r.gathered + r.full_gradients for r in ranks)
        if n > 1 and floor > memory:
            return None, (f"the gathered parameters and full gradients alone take "
                          f"{gib(floor)} GiB on every rank, at any N")
    return None, (f"at no N tried up to {tried[-1]} (every N to 16, then "
                  f"{', '.join(map(str, tried[16:19]))}, ...)")


def gib(nbytes: int) -> str:
    # A few KiB freed would print as "-0.00".
    return f"{nbytes / GiB:.2f}".replace("-0.00", "0.00")


#: Column -> RankMemory field; the fully sharded pass's two only where a row
#: has them, ``freed`` only where a row frees something (RankMemory.freed).
COLUMNS = {"params": "parameters", "freed": "freed", "grads": "gradients",
           "accum": "accumulation", "opt state": "optimizer", "masters": "masters",
           "gathered": "gathered",
           "full grads": "full_gradients", "comm": "communication",
           "new params": "new_parameters", "temps": "temporaries",
           "acts": "activations", "peak": "peak"}


def dominant(rank: RankMemory) -> str:
    """The column of the largest part of a rank's peak."""
    parts = {c: getattr(rank, f) for c, f in COLUMNS.items() if f != "peak"}
    return max(parts, key=parts.get)


def largest_batch(model: Model, optimizer: str, mode: str, world_size: int, memory: int,
                  activations_of, limit: int = 1 << 16, **options) -> int:
    """The largest batch size whose fullest rank fits ``memory`` at ``world_size`` (0: none).

    ``activations_of(batch)``: the activation bytes of a batch of that size.
    """
    def fits(batch: int) -> bool:
        ranks = estimate_ranks(model, optimizer, mode, world_size, budget=memory,
                               activations=activations_of(batch), **options)
        return max(r.peak for r in ranks) <= memory

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def table(rows: Sequence[Row], memory: Optional[int], lead=None) -> str:
    """Aligned columns, GiB per rank (the fullest rank), one line per mode and N.

    ``lead``: ``(headers, cells per row)`` put after the mode and N.
    """
    fully = any(row.mode == "fully_shard" for row in rows)
    freed = any(row.fullest.freed for row in rows)
    columns = [c for c in COLUMNS if (fully or c not in ("gathered", "full grads"))
               and (freed or c != "freed")]
    extra, cells_of = lead or ([], [[] for _ in rows])
    header = ["mode", "N"] + list(extra) + columns + (
        [f"fits {gib(memory)} GiB"] if memory is not None else [])
    lines = [header]
    for row, first in zip(rows, cells_of):
        d = row.fullest.to_dict()
        cells = [row.mode, str(row.world_size)] + list(first) + [gib(d[COLUMNS[c]])
                                                                 for c in columns]
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
            parts.append(f"{LABELS[row.mode]} {gib(peak)} GiB{fit}")
        out.append(f"N={n}: " + ", ".join(parts))
    return out


def describe(name: str) -> str:
    return optimizers.OPTIMIZERS[name][0]
