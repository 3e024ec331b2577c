"""The optimizer's temporaries: how many updates run at once, and what they hold.

What one array's update allocates is in :mod:`mlx_fsdp.plan_memory.updates`
(:data:`~mlx_fsdp.plan_memory.updates.PROFILES`).

How many updates overlap (:func:`in_flight`): MLX orders a graph
breadth-first at most ``MLX_BFS_MAX_WIDTH`` (20) nodes wide, and an
update runs three or four independent chains (the moments, the parameter),
so about :data:`CHAINS` updates are under way at once, each holding its
``live`` bytes; and on top of that the main thread queues up to
:data:`IN_FLIGHT_OPS` operations ahead of the worker, allocating their
outputs when it queues them, so the ``total`` of the updates those
operations belong to (largest first, a fraction of the last) can be alive
too. Both measured on the CPU (mlx 0.32.4); a GPU's compiled update stays within them.

An eager update on a GPU runs ahead further: MLX frees a GPU array's
buffer only once the command buffer that used it has finished, and the
main thread waits for the GPU only when more than 10 command buffers are
under way; so the outputs of about :data:`GPU_IN_FLIGHT_OPS` operations
can be alive at once. On one H100 (mlx-cuda 0.32.4, 2026-11-27,
``bench_plan_memory.py --hidden 256``, N=2 and 4), ``ddp_step`` with AdamW,
Adam, Lion and Adafactor peaked at up to 1.32x the plan with the CPU's
window, 0.75-0.95x with this one; ``fsdp_step``, whose update is compiled
there, at 0.59-0.95x with the CPU's. ``ddp_step`` compiles its update
there too: 2 to 40 kernels an array (``Profile.kernels``), not 7 to 68
operations, so the command buffers hold more arrays' updates: planned as
eager, the GPT with Adafactor peaked at 1.046x (the same H100, N=2 and 4),
over 240 of its kernels at 0.27-0.86x. ``fsdp_step``'s compiled update on
its pieces stays within the CPU's window there.

The plain optimizer's eager update of whole arrays on the CPU (``ddp_step``,
and any wrapper on one process) holds more once there are many arrays:
it is counted from what it was measured to hold (:data:`PLAIN`).
"""

from typing import Dict, NamedTuple, Optional, Sequence, Tuple

from .updates import Update, costs, matmul_workspace

#: Operations the CPU scheduler keeps queued ahead of the worker (``10`` tasks
#: of ``10`` dispatches, two per operation), measured: independent products of
#: a held array, each followed by a sum that frees it, left 25 products
#: allocated at once whatever their number (50 ops).
IN_FLIGHT_OPS = 50

#: Element-wise operations the CPU scheduler keeps queued ahead of a busy
#: worker: products of a held vector by a scalar, each followed by a sum
#: that frees it, left 35 products allocated at once (70 operations); with
#: an addition after each product, 25 (75); a matrix product of a sum, 20 of
#: each (60; mlx 0.32.4, 2026-11-29). ``ddp_step``'s eager updates, queued
#: while the worker packs and all-sums the gradients, are counted over it
#: (:func:`mlx_fsdp.plan_memory.phases.ddp_fullest`).
ELEMENTWISE_IN_FLIGHT_OPS = 75

#: Operations an eager update on a GPU can have queued: MLX's main thread
#: waits once more than 10 command buffers are unfinished (``MAX_ACTIVE_TASKS``
#: in mlx/transforms.cpp), so 11 committed and one being filled, of up to 20
#: operations each on CUDA (``MLX_MAX_OPS_PER_BUFFER``; assumed on Metal).
GPU_IN_FLIGHT_OPS = 12 * 20

SCALAR_BYTES = 4  #: Bytes of one operation's scalar output (Adafactor's norms and rates).

#: Updates under way at once, each holding its ``live`` bytes: fitted on the
#: CPU (the BFS width over an update's three chains, 7, over-predicted the
#: grid by 1.2-1.9x). Counted with that width beside a flat bucket's gather
#: from session 29, many small buckets' updates needed it no more once
#: what the pass between the gathers holds was counted (2026-11-29,
#: :func:`mlx_fsdp.plan_memory.phases.fsdp_fullest`).
CHAINS = 2


#: On the CPU, eager, the plain optimizer's updates of whole arrays
#: (``ddp_step``, one process) hold more than :func:`in_flight` counts once
#: there are many arrays: MLX's graph order starts many updates before it
#: finishes the first. Measured (the plain optimizer on 1 to 192 equal
#: arrays of 64 x 64 to 1024 x 1024, each with or without a bias, mlx
#: 0.32.4, 2026-11-28), the arrays of an update's size alive at once beyond
#: the model state did not depend on their size: SGD held every update's
#: new values up to 40 updates (a bias took a place as a matrix did: 20
#: matrices with their biases); AdamW's grew to 37 arrays, 18 with biases;
#: Lion's and Muon's by one an array however many (216 and 223 arrays for
#: 192). With :data:`CHAINS` and :data:`IN_FLIGHT_OPS` SGD on 64 arrays of
#: 1024 x 1024 held 160 MiB against 36 counted. Per optimizer, ``(whole,
#: kept, run)``: of any ``run`` consecutive updates (in tree order, as they
#: are evaluated; ``None``: all of them) each keeps ``kept`` arrays of its
#: size (at most its total) and the ``whole`` largest their total; the
#: least that covered every point measured within 1% of its temporaries.
PLAIN = {"sgd": (0, 1, 40), "adamw": (4, 1.5, 20), "adam": (5, 2, 20), "lion": (9, 1, None),
         "adafactor": (1.5, 3, 16), "muon": (2, 1, None)}


#: Optimizers whose plain eager update, through a master copy, keeps the
#: gradient's copy in the master dtype too, beyond :data:`PLAIN`'s arrays
#: (measured on float32): SGD's momentum arithmetic has nothing to take its
#: buffer over from in time. The MLP 4 x 512 in bfloat16 with float32 masters
#: (2026-11-29) peaked at 20.04 MiB on one process, 16.53 counted without it;
#: at ring N=2 and MPI N=4 1.10x and 1.09x above. The others' counts held it.
PLAIN_UPCAST = ("sgd",)

#: :data:`PLAIN` where the updates run through master copies (the others as
#: there). The update then works on the gradient's float32 copy, which
#: nothing else holds, so MLX writes into it where the float32 update must
#: allocate: with the float32 constants, 96 points of ``ddp_step`` and of
#: one process in bfloat16 (2026-11-29) read up to 1.38x (AdamW), 1.33x
#: (Adam), 1.60x (Lion) and 1.55x (Muon). These are the least of a grid
#: that covered all 96 with 2% to spare, keeping each optimizer's run
#: (1.05-1.11x, 1.05-1.18x, 1.12-1.32x, 1.12-1.30x; Muon's one array per
#: array halved, not dropped as the fit allowed). Measured after: 48 points
#: of other shapes, 1.02-1.40x; 14 of deeper models (the MLP 192 x 64, 384
#: arrays, on one process), 1.02-1.38x (Lion 1.13-1.22x, Muon 1.22-1.33x).
#: Adafactor's since session 33: with :data:`PLAIN`'s, its 47 points of
#: those sets read 1.10-1.57x, 28 above 1.3x; with these, the least of the
#: grids that kept the closest point (1.11x), 1.11-1.43x, 8 above; and 30
#: points measured after, of other shapes (the MLP 64 x 128 and 3 x 1024
#: and mlx-lm's Llama 8 x 192 on one process, the GPT 4 x 192 and the Llama
#: 6 x 256 at ring N=2, the MLP 6 x 384 at MPI N=3; 2026-11-29), Adafactor's
#: 1.17-1.29x (1.17-1.40x before). AdamW's kept 1.6 since session 41: at
#: 1, mlx-lm's Llama of one or two blocks (none of those fitted) peaked
#: above the plan on one process (1 x 256: 22.36 MiB, 21.87 counted;
#: 2026-11-30); 1.6 is the least that covers 55 points with 2% to spare.
PLAIN_MASTER = {"adamw": (2, 1.6, 20), "adam": (2, 2, 20), "lion": (4, 1, None),
                "muon": (1.5, 0.5, None), "adafactor": (2, 2.5, 12)}

#: Arrays of a piece's size Lion keeps from its update to the step's end in
#: ``fsdp_step`` on the CPU: its new moment does not feed its new
#: parameter, and MLX evaluates the state after the new parameters (the
#: gathers' views), so what the moment's chain was given lives on (MLP 64 x
#: 128 in 128 KiB buckets at ring N=2, 2026-11-28: 14.69 MiB, 13.32 counted
#: without; the plain update's count has it, :data:`PLAIN`). Not through
#: float32 masters: counted there, mlx-lm's Llama 12 x 768 in bfloat16 at
#: ring N=2 read 1.335x, the MLP 4 x 512 in 1 MiB buckets 1.353x; without
#: it every recorded Lion ``fsdp_step`` point in bfloat16 stays below the
#: plan, the closest at 1.023x (2026-11-30).
KEPT_TO_THE_END = {"lion": 1}

#: Optimizers none of whose updates was seen alive at the gather of a flat
#: bucket alone in its step, which waits for them, but for what Lion keeps
#: to the step's end (:data:`KEPT_TO_THE_END`) (:mod:`mlx_fsdp.step`;
#: past one bucket they are counted): at ring N=2, SGD and Lion on the MLP
#: 4 x 256 peaked at 4.52 MiB, the gather's buffers alone counted 4.58 (the
#: MLP 6 x 384: 15.23 and 15.29); AdamW 0.44 MiB above them (5.52 against
#: 5.08), so Adam's, AdamW's and the others' updates under way are counted
#: there (2026-11-29). Eager only: compiled, as on a GPU
#: (:mod:`mlx_fsdp.fused`), Lion's update on that MLP held 0.19 MiB more
#: than the gather's buffers (4.77 MiB).
NOTHING_AT_OWN_GATHER = ("sgd", "lion")


class Temporaries(NamedTuple):
    """Bytes the updates under way hold (``side``: :func:`in_flight`'s chains and
    any workspace), those queued ahead of them (``ahead``), and what every update
    allocates in all (``most``: totals, workspace, :data:`SCALAR_BYTES` per
    operation), which no overlap of them can exceed."""

    side: int
    ahead: int
    most: int
    kept: int = 0  #: what lives on to the step's end (:data:`KEPT_TO_THE_END`)
    tail: int = 0  #: what meets a lone flat bucket's gather (:data:`NOTHING_AT_OWN_GATHER`)
    last: int = 0  #: an owner bucket's last update under way (eager CPU: the largest ``live``)

    @property
    def together(self) -> int:
        """``side`` and ``ahead`` at once, at most ``most``."""
        return min(self.side + self.ahead, self.most)


def in_flight(updates: Sequence[Update], window: int = IN_FLIGHT_OPS) -> Tuple[int, int]:
    """``(chains, ahead)``: the bytes of updates under way side by side, and of
    the ones the main thread queued ahead of the worker (see the module docstring).

    ``chains``: the ``live`` bytes of the :data:`CHAINS` largest updates;
    ``ahead``: the ``total`` bytes of the largest updates until their operations
    make ``window`` (the last in proportion). Default: :data:`IN_FLIGHT_OPS`.
    """
    live = sorted((u.live for u in updates), reverse=True)
    chains = sum(live[:CHAINS])
    ahead, left = 0, window
    for u in sorted(updates, key=lambda u: -u.total):
        if left <= 0:
            break
        ahead += u.total * min(1.0, left / max(u.ops, 1))
        left -= u.ops
    return chains, int(ahead)


def plain_window(updates: Sequence[Update], whole: float, kept: float,
                 run: Optional[int] = None) -> int:
    """Bytes the plain optimizer's eager updates hold at once on the CPU, ``updates``
    in the order they are evaluated (see :data:`PLAIN`)."""
    run = len(updates) if run is None else min(run, len(updates))
    fullest = 0
    for start in range(0, len(updates) - run + 1):
        those = updates[start:start + run]
        held = [min(u.total, int(kept * u.array)) for u in those]
        rest = sorted((u.total - h for u, h in zip(those, held)), reverse=True)
        count = int(whole)  # the largest ``count`` whole, and a fraction of the next
        more = sum(rest[:count]) + int((whole - count) * sum(rest[count:count + 1]))
        fullest = max(fullest, sum(held) + more)
    return fullest


def temporaries(optimizer: str, pieces: Sequence[Tuple[str, object]], master_dtype=None,
                compiled: bool = False, device: str = "cpu", whole_arrays: bool = False,
                traced: bool = False) -> int:
    """Bytes of the optimizer's temporaries alive at once in one rank's step.

    Args:
        optimizer (str): A key of :data:`mlx_fsdp.plan_memory.optimizers.OPTIMIZERS`.
        pieces (list): ``(path, array)`` of what this rank updates (whole
            arrays, or its pieces of them), shape-only.
        master_dtype (Dtype, optional): The masters' dtype. Default: ``None``.
        compiled (bool): The step compiles its update (on a GPU, and for
            ``ddp_step`` on more than one process:
            :func:`mlx_fsdp.fused.use_fused_updates`). Default: ``False``.
        device (str): ``"cpu"`` or ``"gpu"``, where the step runs. Default: ``"cpu"``.
        whole_arrays (bool): ``pieces`` are whole arrays (``ddp_step``).
            Default: ``False``.
        traced (bool): The whole step is compiled (``mx.compile``, as mlx-lm's
            trainer runs it), and its update with it. Default: ``False``.

    Returns:
        int: ``side + ahead`` of :func:`temporaries_apart`, not capped at
        ``most``: capped, an H100's fully sharded step measured above it.
    """
    temps = temporaries_apart(optimizer, pieces, master_dtype, compiled, device, whole_arrays,
                              traced)
    return temps.side + temps.ahead


def temporaries_apart(optimizer: str, pieces: Sequence[Tuple[str, object]], master_dtype=None,
                      compiled: bool = False, device: str = "cpu", whole_arrays: bool = False,
                      traced: bool = False) -> Temporaries:
    """:func:`temporaries` in parts (:class:`Temporaries`); its arguments."""
    updates = update_costs(optimizer, pieces, master_dtype, compiled or traced)
    return overlap(optimizer, list(updates.values()), compiled, device, whole_arrays, traced)


def update_costs(optimizer: str, pieces: Sequence[Tuple[str, object]], master_dtype=None,
                 compiled: bool = False) -> Dict[str, Update]:
    """``{path: Update}`` of every piece with elements (see :func:`temporaries`)."""
    master_size = master_dtype.size if master_dtype is not None else 0
    return costs(optimizer, [(p, tuple(a.shape), a.dtype.size) for p, a in pieces],
                 master_size, compiled)


def overlap(optimizer: str, updates: Sequence[Update], compiled: bool = False,
            device: str = "cpu", whole_arrays: bool = False,
            traced: bool = False) -> Temporaries:
    """What ``updates`` (:func:`update_costs`) hold at once; :func:`temporaries`' arguments.

    ``ahead`` is counted on a GPU over :data:`GPU_IN_FLIGHT_OPS`, of compiled
    kernels for ``ddp_step``'s compiled update and in a step compiled whole,
    where the kernels fill the CPU's window too (an MLP 8 x 1024 with AdamW
    held every update's new shard and moments at once, 2026-11-28); it can
    meet whatever the step queues next.
    """
    workspace = matmul_workspace(optimizer, device)
    eager_cpu = device == "cpu" and not (compiled or traced)
    if whole_arrays and eager_cpu:
        upcasts = in_flight([u._replace(total=u.upcast) for u in updates])[1] \
            if optimizer in PLAIN_UPCAST else 0  # of the updates queued ahead
        most = allocated(updates, workspace) + upcasts
        table = PLAIN_MASTER if any(u.upcast for u in updates) else PLAIN
        plain = min(most, plain_window(updates, *table.get(optimizer, PLAIN[optimizer])) + upcasts)
        # Of them, what can be queued ahead; element-wise, as they all are.
        queued = min(plain, in_flight(updates, ELEMENTWISE_IN_FLIGHT_OPS)[1])
        return Temporaries(plain - queued, queued, most)
    kernels = traced or (device == "gpu" and compiled and whole_arrays)  # module docstring
    if kernels:
        updates = [u._replace(ops=u.kernels) for u in updates]
    window = GPU_IN_FLIGHT_OPS if device == "gpu" and (kernels or not compiled) else IN_FLIGHT_OPS
    chains, ahead = in_flight(updates, window)
    most = allocated(updates, workspace)
    kept = 0 if any(u.upcast for u in updates) else \
        int(KEPT_TO_THE_END.get(optimizer, 0) * sum(u.array for u in updates))
    # Compiled (MLX_FSDP_FUSED_UPDATE=1 on the CPU), an owner bucket's gather
    # met two updates: Adafactor on the MLP 4 x 256 at ring N=2 peaked at
    # 6.29 MiB, 6.10 counted with one (2026-11-29).
    side = chains + workspace
    tail = 0 if optimizer in NOTHING_AT_OWN_GATHER and eager_cpu else side
    last = max((u.live for u in updates), default=0) + workspace if eager_cpu else side
    return Temporaries(side, ahead, most, kept if eager_cpu else 0, tail, last)


def allocated(updates: Sequence[Update], workspace: int) -> int:
    """What every update allocates (:class:`Temporaries`' ``most``); ``ops`` counted as run."""
    return sum(u.total + SCALAR_BYTES * u.ops for u in updates) + workspace
