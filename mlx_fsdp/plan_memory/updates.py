"""What one array's update allocates, optimizer by optimizer.

How many updates overlap is in :mod:`mlx_fsdp.plan_memory.transient`.

An update (``apply_single`` of one array, or of this rank's piece of it)
allocates a few arrays of its size on top of the state it replaces: AdamW's
``(1 - b1) * g`` and ``g * g``, which cannot reuse the gradient's buffer
because the caller still holds it, ``sqrt(v)``; Muon's Newton-Schulz
products ``X X^T`` (``k x k``, ``k = min(rows, cols)``) and ``B X``; with
master copies, the float32 copy of the gradient and the new parameter cast
back. MLX reuses an input's buffer where nothing else holds it, so the rest
costs nothing. Per optimizer, :data:`PROFILES` gives, in elements of the step's dtype:

* ``total``: everything one update allocates (its new values included),
  measured with the worker held back so that nothing is freed before the
  last operation is queued (``mx.async_eval`` of a large product first);
* ``live``: the most of it alive at once when MLX runs it alone with a
  1-byte memory limit, which makes it free each buffer before queuing more;
* ``ops``: the operations of one update (nodes of ``mx.export_to_dot``);
* ``kernels``: the same, compiled as :mod:`mlx_fsdp.fused` compiles it (the
  element-wise chain fuses into one or two kernels), counted on the CPU; a
  GPU's is assumed alike (``mx.compile`` fuses before the backend).

``tests/test_plan_memory.py`` holds ``ops`` and ``kernels`` to the nodes of
MLX's own graph of one update; the grid of ``bench_plan_memory.py`` holds
the sum. One update alone, with the caller holding the old parameter
(mlx 0.32.4, CPU, a 2**20-element vector, 2026-11-26), peaked at, in
elements per element (one limited to a 1-byte memory limit in brackets):
AdamW 5 (3), Adam 4 (2), SGD 1 (1), Lion 4 (3), Adafactor on a matrix 5
(3); compiled as ``fsdp_step`` runs it on a GPU (:mod:`mlx_fsdp.fused`):
3, 3, 2, 2, 5. AdamW's total and live and SGD's compiled total are above
their profiles: the margin comes from counting the largest updates twice
(:func:`~mlx_fsdp.plan_memory.transient.in_flight`; in ``fsdp_step``'s phases
at most all updates' totals),
not from each profile. Lion's live, 2 until the reduce-scatters were no
longer counted all at once, measured above the plan (mlx-lm's Llama 4 x
256, 0.5 MiB buckets, ring N=2: 46.80 MiB, 45.42 counted; 2026-11-28).
Through a float32 master a bfloat16 parameter's update peaked 0.5 float32
elements per element above the float32 update (its new bfloat16 value),
within 0.5 of it under the limit (2026-11-26): the gradient's float32 copy
is a temporary the float32 update holds as well.
"""

import math
from typing import Dict, NamedTuple, Sequence, Tuple

from .optimizers import muon_filter


class Profile(NamedTuple):
    """One update's cost in elements of the step's dtype per element updated."""

    total: float
    live: float
    ops: int
    kernels: int


#: Muon on a CUDA GPU: its Newton-Schulz products run through ``mx.addmm``,
#: which MLX hands to cuBLASLt with a workspace of up to 32 MiB on Hopper
#: (4 MiB before), kept until the GPU finishes its command buffer. On one
#: H100 (mlx-cuda 0.32.4, 2026-11-26) ``ddp_step`` with Muon on an MLP of 256
#: peaked at 95.98 MiB at N=2 and N=4 alike, against 12.1 MiB counted
#: without it; ``fsdp_step`` at N=4, 15.9 MiB above. So three workspaces
#: (one Newton-Schulz iteration's products) are counted on a GPU, the one
#: point measured; Metal has no such workspace, and errs on the safe side.
MUON_GPU_WORKSPACE = 3 * 32 * 2**20


def matmul_workspace(optimizer: str, device: str) -> int:
    """Bytes of matmul workspace the update adds on ``device`` (see :data:`MUON_GPU_WORKSPACE`)."""
    return MUON_GPU_WORKSPACE if optimizer == "muon" and device == "gpu" else 0


#: name -> profile of a vector (and of a matrix for the element-wise ones).
PROFILES = {
    "adamw": Profile(4, 2, 23, 2),
    "adam": Profile(4, 2, 19, 2),
    "sgd": Profile(1, 1, 7, 2),
    "lion": Profile(4, 3, 15, 3),
    "adafactor": Profile(5, 2, 37, 9),
}
#: Adafactor on a matrix (its factored statistics take more operations), and
#: Muon's operations of five Newton-Schulz steps, eager and compiled.
ADAFACTOR_MATRIX, MUON_OPS, MUON_KERNELS = Profile(5, 3, 62, 22), 68, 40
#: With a master copy: the gradient cast up, the new parameter cast down
#: (compiled, one more kernel is counted for them, not measured).
MASTER_OPS = 2
#: Compiled (:mod:`mlx_fsdp.fused`, ``fsdp_step`` on a GPU), an update writes
#: its new state and parameter without reusing the old buffers: elements per
#: element where that is more than the eager profile's (measured: compiled
#: SGD with momentum 2, AdamW and Adam 3, Lion 2, Adafactor 5).
COMPILED_TOTAL = {"sgd": 2}


class Update(NamedTuple):
    """One array's (or piece's) update on one rank, in bytes and operations."""

    total: int
    live: int
    ops: int
    kernels: int
    array: int = 0  #: bytes of one array of the update's size, in the dtype it runs in
    upcast: int = 0  #: bytes of the gradient's copy in the master dtype (0: no master)


def update_cost(optimizer: str, path: str, shape: Sequence[int], param_size: int,
                master_size: int = 0, compiled: bool = False) -> Update:
    """What updating one array (or this rank's piece of it) allocates.

    Args:
        optimizer (str): A key of :data:`mlx_fsdp.plan_memory.optimizers.OPTIMIZERS`.
        path (str): The array's path (Muon leaves some arrays to AdamW).
        shape (tuple): The shape updated (a piece's, under FSDP).
        param_size (int): Bytes per element of the parameter.
        master_size (int): Bytes per element of its master copy; 0 for none.
        compiled (bool): The update is compiled (see :data:`COMPILED_TOTAL`).
            Default: ``False``.

    Returns:
        Update: Bytes allocated in all, bytes alive at once, operations
        (eager and compiled).
    """
    n = math.prod(shape)
    size = master_size or param_size
    # With a master, the new parameter in its own dtype. The gradient's copy
    # in the master dtype costs nothing on top: nothing else holds it, so
    # MLX reuses its buffer, where a float32 update must leave the caller's
    # gradient alone and allocates that temporary anyway.
    cast = n * param_size if master_size else 0
    upcast = n * size if master_size else 0
    ops, kernels = (MASTER_OPS, 1) if master_size else (0, 0)
    matrix = len(shape) == 2 and n > 0
    if optimizer == "muon" and matrix and muon_filter(path, _Shape(shape)):
        rows, cols = shape
        k = min(rows, cols)
        # Newton-Schulz: X X^T and its products (k x k), B X and a X (rows x
        # cols) per step; a tall matrix is worked on transposed, which costs
        # two copies more (one update alone on the CPU, 2026-11-27: 15.5 n
        # for 512 x 128 and 1024 x 256, 16.33 n for 384 x 128 and 300 x 100).
        total = (11 + 2 * (rows > cols)) * n + 10 * k * k
        live = 3 * n + 3 * k * k
        return Update(total * size + cast, live * size + cast, MUON_OPS + ops,
                      MUON_KERNELS + kernels, n * size, upcast)
    name = "adamw" if optimizer == "muon" else optimizer
    profile = ADAFACTOR_MATRIX if name == "adafactor" and matrix else PROFILES[name]
    if compiled and name in COMPILED_TOTAL:
        most = max(profile.total, COMPILED_TOTAL[name])
        profile = profile._replace(total=most, live=max(profile.live, most))
    return Update(int(profile.total * n * size) + cast, int(profile.live * n * size) + cast,
                  profile.ops + ops, profile.kernels + kernels, n * size, upcast)


class _Shape(NamedTuple):
    """What :func:`muon_filter` asks of an array: its number of dimensions."""

    shape: tuple

    @property
    def ndim(self) -> int:
        return len(self.shape)


def costs(optimizer: str, pieces: Sequence[Tuple[str, Sequence[int], int]],
          master_size: int = 0, compiled: bool = False) -> Dict[str, Update]:
    """``{path: update_cost}`` of every ``(path, shape, bytes per element)`` with elements."""
    return {path: update_cost(optimizer, path, shape, size,
                              master_size if size != master_size else 0, compiled)
            for path, shape, size in pieces if math.prod(shape)}
