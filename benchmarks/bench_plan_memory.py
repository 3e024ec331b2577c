"""The memory planner against measurement: predicted vs real bytes per rank.

For each model, optimizer and mode, in a phase of its own: build the model
and the real wrapper (``ddp_step`` or ``fsdp_step``), take one step with
fixed, precomputed gradients (which builds the state and the plan), then
reset the peak and take more steps with the same gradients (``--repeat``;
the highest peak counts): no forward or backward pass, so the peak is the
optimizer step's own (parameters, gradients, state, masters, communication
buffers and the update's temporaries), which is what ``python -m
mlx_fsdp.plan_memory`` predicts, less the temporaries. Each rank reports:

* **state**: bytes of every array of ``opt.state["optimizer"]`` (scalars
  included) and of ``opt.state["master"]``, against the planner's
  prediction for this rank: they must be equal;
* **peak**: ``mx.get_peak_memory()`` of the fullest measured step, against
  the predicted peak (max over ranks of both).

Fully sharded training (``--modes fully_shard``: ``fully_shard`` on each
block and the root, or on the whole model with ``--wrap model``, and
``fsdp_step``) is measured over whole training steps instead (forward,
backward and ``opt.update``, one ``mx.eval``, as docs/fully-shard.md's example runs
them): its peak is in the backward pass, where the gathered parameters live.
Each rank's parameter and gradient bytes are checked too; the planner's
activations for the MLP and the GPT (not Llama-shaped) are measured on the
unwrapped model's forward and backward pass (``activations_of``: what its
forward pass keeps, or its peak less its gradients, the fuller; with every
block under ``mx.checkpoint`` where the blocks are resharded, which
recompute theirs, as the planner counts them) and given to it, the MLP's
input in the model's dtype; a Llama's are the planner's own count for its
batch (``--batch-size`` x ``--seq-len``), so its points check the whole plan.
With ``--compile`` the step (``fully_shard`` or ``fsdp``) is compiled whole
with ``mx.compile``, its model and optimizer state as inputs and outputs,
as mlx-lm's trainer (and so ``python -m mlx_fsdp.lora``) runs it.

Models: the MLP of ``bench_step.py``, the byte-level GPT of
``examples/lm.py`` and (``--models llama``, with mlx-lm installed) mlx-lm's
own Llama, the shape users plan for: no biases, RMSNorm, grouped-query
attention, ``--gpt-layers`` blocks of ``--dims``. Rank 0 prints one
markdown row per point.
``--memory-limit`` sets ``mx.set_memory_limit``: on the CPU, MLX then
allocates no buffer ahead of the work that fills it. ``--unpaced`` turns
the CPU's pacing off (``mlx_fsdp.pace``), so the step's graph runs in the
order MLX gives it, as on a GPU.

    mlx.launch -n 2 --backend ring -- python benchmarks/bench_plan_memory.py
    mpirun --allow-run-as-root --oversubscribe -n 4 python benchmarks/bench_plan_memory.py
    python benchmarks/bench_plan_memory.py --models mlp --optimizers adamw muon --json out.json
    mlx.launch -n 2 --backend ring -- python benchmarks/bench_plan_memory.py \
        --record benchmarks/records/plan_memory.jsonl   # then: python benchmarks/replan_records.py
    mlx.launch -n 2 --backend ring -- python benchmarks/bench_plan_memory.py --modes fully_shard \
        --reshard-after-forward off on
"""

import argparse
import gc
import json
import os
import sys
import time
from functools import partial

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
sys.path.insert(0, HERE)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

import mlx_fsdp  # noqa: E402
from mlx_fsdp.plan_memory import estimate, optimizers, shapes  # noqa: E402
from mlx_fsdp import collectives, layout, pace  # noqa: E402
from mlx_fsdp.plan_memory.activations import (  # noqa: E402
    Shape, activation_bytes, pass_of)
from mlx_fsdp.plan_memory.buffers import default_device  # noqa: E402
from mlx_fsdp.plan_memory.estimate import tree_bytes  # noqa: E402
from _common import MLP  # noqa: E402
from lm import VOCAB, ByteGPT  # noqa: E402
from lm import loss_fn as lm_loss  # noqa: E402
from lm import parse_size  # noqa: E402

MiB = 1024**2


def build(name: str, args):
    """The model ``name`` names, initialized from seed 0 (the same on every rank)."""
    mx.random.seed(0)
    if name == "mlp":
        model = MLP(args.hidden, args.layers)
    elif name == "llama":  # mlx-lm's own Llama: no biases, RMSNorm, grouped-query attention
        from bench_activations import build as llama
        model = llama(llama_shape(args), "float32", checkpoint=False)
    else:
        model = ByteGPT(args.dims, args.gpt_layers, heads=4, seq_len=64)
    if args.dtype != "float32":
        model.set_dtype(getattr(mx, args.dtype))
    mx.eval(model.parameters())
    return model


def llama_shape(args) -> Shape:
    """The ``--models llama`` shape: ``--gpt-layers`` blocks of ``--dims``, 4 heads, 2 KV heads."""
    return Shape(args.gpt_layers, args.dims, 11 * args.dims // 4, VOCAB, 4, 2)


def loss_of(model, name: str, rank: int, args, own_dtype: bool = False):
    """This rank's loss function on fixed inputs (of the model before wrapping).

    ``own_dtype``: the MLP's input in the model's dtype, as a model's own
    pass feeds its layers (fully sharded points): a float32 input to a
    bfloat16 MLP runs its whole pass in float32 and casts every gradient
    back, which its unwrapped pass (``activations_of``) holds for every
    layer at once.
    """
    key = mx.random.key(100 + rank)
    if name == "mlp":
        x = mx.random.normal((8, model.layers[0].weight.shape[1]), key=key)
        x = x.astype(model.layers[0].weight.dtype) if own_dtype else x
        return lambda m: (m(x).astype(mx.float32) ** 2).mean()
    tokens = mx.random.randint(0, VOCAB, (args.batch_size, args.seq_len + 1), key=key)
    return lambda m: lm_loss(m, tokens[:, :-1], tokens[:, 1:])


def gradients(model, name: str, rank: int, args):
    """This rank's gradients from one real backward pass, evaluated and then held fixed.

    Real gradients, not random arrays: MLX returns a ``Linear`` weight's
    gradient as a transposed view, and the step's copies depend on that.
    """
    _, grads = nn.value_and_grad(model, loss_of(model, name, rank, args))(model)
    mx.eval(grads)
    return grads


def activations_of(model, loss) -> int:
    """Bytes of the unwrapped model's activations: the planner's ``activations`` for a
    model that is not Llama-shaped (measured, max of 2).

    The fuller of what the forward pass holds for the backward pass (its
    peak, the loss evaluated first) and the whole pass's peak less all its
    gradients. The second alone left out the gradients not yet made at the
    peak, which is early in the backward pass when the activations are
    large: the GPT 8 x 128 read 9.39 MiB where its forward pass keeps 13.83,
    and fully sharded at MPI N=4 it measured 1.79 MiB above the plan
    (2026-11-28).
    """
    worst = 0
    for _ in range(2):
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        value, grads = nn.value_and_grad(model, loss)(model)
        mx.eval(value)
        forward = mx.get_peak_memory() - before
        mx.eval(grads)
        worst = max(worst, forward, mx.get_peak_memory() - before - tree_bytes(grads))
        del value, grads
    return worst


class _Checkpointed(nn.Module):
    """A block under ``mx.checkpoint`` (``nn.utils.checkpoint``)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def __call__(self, *args, **kwargs):
        return nn.utils.checkpoint(self.module)(*args, **kwargs)


def pass_activations(model, name: str, loss, recomputed: bool) -> int:
    """``activations_of(model, loss)``; with ``recomputed``, of the model with every
    block under ``mx.checkpoint``: the planner counts blocks resharded after
    their forward pass as checkpointed (``pass_of``), since ``fully_shard``
    recomputes them in the backward pass."""
    if not recomputed:
        return activations_of(model, loss)
    blocks = model.blocks if name == "gpt" else model.layers
    kept = list(blocks)
    for i in range(len(blocks)):
        blocks[i] = _Checkpointed(blocks[i])
    try:
        return activations_of(model, loss)
    finally:
        for i, block in enumerate(kept):
            blocks[i] = block


def fully_shard(model, name: str, optimizer, reshard: bool, args, group):
    """``model`` wrapped as the planner's ``--wrap`` says, placed for ``optimizer``."""
    kwargs = dict(group=group, placement=optimizer)
    if args.communication_size is not None:
        kwargs["communication_size"] = args.communication_size
    if args.wrap == "blocks":
        blocks = model.blocks if name == "gpt" else model.layers
        for i in range(len(blocks)):
            blocks[i] = mlx_fsdp.fully_shard(blocks[i], reshard_after_forward=reshard, **kwargs)
        return mlx_fsdp.fully_shard(model, **kwargs)
    return mlx_fsdp.fully_shard(model, reshard_after_forward=reshard, **kwargs)


def wrapper(optimizer, mode: str, args, group):
    """The real ``ddp_step`` / ``fsdp_step`` for this point."""
    kwargs = dict(group=group, master_dtype=mx.float32 if args.dtype != "float32" else None)
    if args.communication_size is not None:
        kwargs["communication_size"] = args.communication_size
    if args.max_norm is not None:
        kwargs["max_norm"] = args.max_norm
    if args.accumulation != "none":
        kwargs["grad_accumulation_steps"] = 2
        if mode != "ddp":
            kwargs["accumulation"] = args.accumulation
    wrap = mlx_fsdp.ddp_step if mode == "ddp" else mlx_fsdp.fsdp_step
    return wrap(optimizer, **kwargs)


def _step(model, opt, value_and_grad, held=None):
    """One step from ``value_and_grad(model)``'s gradients; returns a token to evaluate.

    ``held``: a list that keeps the old parameters referenced across the step
    (as a loop that holds them would), or ``None``.
    """
    _, grads = value_and_grad(model)
    if held is not None:
        held[:] = [model.parameters()]
    opt.update(model, grads)
    return mx.zeros(())


def backend_of(group) -> str:
    """The planner's name of the group's backend: a native reduce-scatter on a
    GPU is counted as NCCL's (its collectives do not cut the pass), else ring's."""
    if collectives.reduce_scatter_method(group) != "native":
        return "ring"
    return "nccl" if default_device() == "gpu" else "jaccl"


def plan_options(args, reshard: bool, activations: int, device: str, reduce_scatter) -> dict:
    """The planner's options for one point of ``args``, as its measurement runs it
    (``reduce_scatter``: the group's method, ``None`` on one process)."""
    return dict(
        master_dtype="float32" if args.dtype != "float32" else None,
        communication_size=args.communication_size, accumulation=args.accumulation,
        device=device, reduce_scatter=reduce_scatter, wrap=args.wrap,
        reshard_after_forward=reshard, every_rank=True, activations=activations,
        compiled=args.compile, keeps_old_parameters=args.hold_old_parameters,
        max_norm=args.max_norm)


def measure(model_name: str, optimizer: str, mode: str, args, group,
            reshard: bool = False) -> dict:
    """One phase: the real step's bytes and peak, and the planner's prediction.

    The peak is the highest of ``args.repeat`` steps after the first: on the
    CPU what overlaps in a step depends on timing (MLX allocates outputs
    ahead of the kernels it has queued), and a training run's peak is that
    of its fullest step, which a few steps can miss. With accumulation (two
    micro-batches per step), the carried sum is measured after the first
    micro-batch of the last step, and each peak over the call that finishes
    a step.
    """
    gc.collect()
    mx.clear_cache()
    model = build(model_name, args)
    plain = shapes.from_tree(model, model_name)  # the module: how its gradients arrive
    inner = optimizers.make(optimizer)
    fully = mode == "fully_shard"
    activations = 0
    if fully:
        loss = loss_of(model, model_name, group.rank(), args, own_dtype=True)
        # A Llama's activations are the planner's own count, as a user's plan has them.
        recomputed = reshard and args.wrap == "blocks" and group.size() > 1
        activations = (pass_activations(model, model_name, loss, recomputed)
                       if model_name != "llama" else
                       activation_bytes(llama_shape(args), args.batch_size, args.seq_len,
                                        getattr(mx, args.dtype).size, device=default_device(),
                                        **pass_of(mode, args.wrap, reshard, args.compile,
                                                  default_device(), backend=backend_of(group),
                                                  world_size=group.size())))
        model = fully_shard(model, model_name, inner, reshard, args, group)
        value_and_grad = nn.value_and_grad(model, loss)
    else:
        fixed = gradients(model, model_name, group.rank(), args)
    opt = wrapper(inner, mode, args, group)
    options = plan_options(args, reshard, activations, default_device(),
                           collectives.reduce_scatter_method(group) if group.size() > 1 else None)
    predicted = estimate(plain, optimizer, mode, group.size(), **options)
    mine = predicted[group.rank() if mode != "ddp" else 0]
    # What the rank holds of gradients: fully sharded, its pass may peak
    # before any has come, so they are the update's.
    held_gradients = estimate(plain, optimizer, mode, group.size(), phases=True, **options)[
        group.rank()][1].gradients if fully and group.size() > 1 else mine.gradients
    per_step = 1 if args.accumulation == "none" else 2
    peak = 0
    # Fully sharded gradients are shaped like what the rank holds (fully_shard's contract).
    grad_bytes = tree_bytes(model.trainable_parameters() if fully else fixed)
    step = partial(_step, model, opt, value_and_grad if fully else (lambda m: (None, fixed)),
                   [] if args.hold_old_parameters else None)
    if args.compile:
        state = [model.state, opt.state]
        step = partial(mx.compile, inputs=state, outputs=state)(step)
    for call in range(per_step * (1 + args.repeat)):
        measured = call >= per_step and (call + 1) % per_step == 0
        if measured:
            accumulated = tree_bytes(opt.state.get("accumulated", {}))
            gc.collect()
            mx.clear_cache()
            mx.reset_peak_memory()
        mx.eval(step(), model.parameters(), opt.state)
        if measured:
            peak = max(peak, mx.get_peak_memory())
    # fsdp_step's new parameters are views of the gathered vectors, whose
    # padding they keep alive, except where unpack copies them out: the real
    # plan's, in the parameters' dtype (compiled, the planner counts every
    # vector's padding there, as alive at the peak).
    padding = sum(b.padding(group.size()) * getattr(mx, b.param_dtype).size
                  for b in opt.plan.buckets if not b.summed(group.size())
                  and (args.compile or not layout.copies_out(b, group.size()))) \
        if mode == "fsdp" and group.size() > 1 else 0
    row = mx.array([tree_bytes(opt.state["optimizer"]), mine.optimizer,
                    tree_bytes(opt.state.get("master", {})), mine.masters,
                    accumulated, mine.accumulation, tree_bytes(model.parameters()) + padding,
                    mine.parameters, grad_bytes, held_gradients, peak], mx.int64)
    rows = mx.distributed.all_gather(row[None], group=group).tolist()
    del model, opt
    gc.collect()
    mx.clear_cache()
    out = {"model": model_name, "optimizer": optimizer, "mode": mode, "n": group.size(),
           "reshard_after_forward": reshard, "compiled": args.compile,
           "reduce_scatter": options["reduce_scatter"],
           "activations": activations}  # as planned: re-plan a row offline with them
    for i, name in enumerate(("state", "masters", "accumulation", "parameters", "gradients")):
        out[name + "_measured"] = [r[2 * i] for r in rows]
        out[name + "_predicted"] = [r[2 * i + 1] for r in rows]
    out["equal"] = all(r[i] == r[i + 1] for r in rows for i in range(0, 10, 2))
    out["peak_measured"] = max(r[10] for r in rows)
    out["peak_predicted"] = max(r.peak for r in predicted)
    out["peak_predicted_parts"] = max(predicted, key=lambda r: r.peak).to_dict()
    # Rank by rank: owners make the ranks differ, and the fullest rank of
    # the measurement need not be the planner's.
    out["peak_measured_ranks"] = [r[10] for r in rows]
    out["peak_predicted_ranks"] = [r.peak for r in predicted]
    return out


#: The settings a record keeps of a run: all that the planner's options and the
#: models read (benchmarks/records/README.md).
RECORDED = ("hidden", "layers", "dims", "gpt_layers", "batch_size", "seq_len", "dtype",
            "communication_size", "accumulation", "wrap", "compile", "unpaced",
            "hold_old_parameters", "max_norm")


def record_of(row: dict, args) -> dict:
    """One measured point as a line of benchmarks/records/plan_memory.jsonl."""
    n = row["n"]
    mpi = any(k.startswith("OMPI_COMM_WORLD") for k in os.environ)
    return {"model": row["model"], "optimizer": row["optimizer"], "mode": row["mode"], "n": n,
            "reshard_after_forward": row["reshard_after_forward"],
            "activations": row["activations"], "device": default_device(),
            "backend": "mpi" if mpi else "ring", "reduce_scatter": row["reduce_scatter"],
            "config": {k: getattr(args, k) for k in RECORDED},
            "measured": row["peak_measured_ranks"],
            "measured_on": time.strftime("%Y-%m-%d", time.gmtime())}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=("mlp", "gpt", "llama"), default=["mlp", "gpt"],
                   help="llama: mlx-lm's Llama (needs mlx-lm), --gpt-layers blocks of --dims "
                   "(default mlp gpt)")
    p.add_argument("--optimizers", nargs="+", choices=list(optimizers.OPTIMIZERS),
                   default=list(optimizers.OPTIMIZERS))
    p.add_argument("--modes", nargs="+", choices=("ddp", "fsdp", "fully_shard"),
                   default=["ddp", "fsdp"])
    p.add_argument("--wrap", choices=("blocks", "model"), default="blocks",
                   help="fully_shard each block, then the model, or the model once (default "
                   "blocks)")
    p.add_argument("--reshard-after-forward", nargs="+", choices=("off", "on"), default=["off"],
                   help="fully_shard's reshard_after_forward for the blocks; both: off on "
                   "(default off)")
    p.add_argument("--compile", action="store_true",
                   help="compile the step whole with mx.compile, as mlx-lm's trainer does "
                   "(fully_shard and fsdp points only)")
    p.add_argument("--unpaced", action="store_true",
                   help="turn the CPU's pacing off (mlx_fsdp.pace.QUEUE_DEPTH = 0): the step "
                   "runs as on a GPU, which MLX does not pace, and the planner counts it so")
    p.add_argument("--hold-old-parameters", action="store_true",
                   help="keep a reference to the old parameters across each step, as a loop "
                   "that holds them would, and plan it so (keeps_old_parameters)")
    p.add_argument("--max-norm", type=float,
                   help="clip the gradients by their global norm (the wrapper's max_norm), and plan "
                   "it so")
    p.add_argument("--memory-limit", type=parse_size,
                   help="mx.set_memory_limit for the run, e.g. 1MiB (default: MLX's own)")
    p.add_argument("--hidden", type=int, default=512, help="MLP width (default 512)")
    p.add_argument("--layers", type=int, default=4, help="MLP layers (default 4)")
    p.add_argument("--dims", type=int, default=128, help="GPT width (default 128)")
    p.add_argument("--gpt-layers", type=int, default=2, help="GPT blocks (default 2)")
    p.add_argument("--batch-size", type=int, default=4,
                   help="the GPT's and the Llama's sequences per batch (default 4)")
    p.add_argument("--seq-len", type=int, default=32,
                   help="their tokens per sequence (default 32; the GPT takes at most 64)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter dtype; bfloat16 gets float32 masters (default float32)")
    p.add_argument("--communication-size", type=int,
                   help="bucket budget in bytes (default: each wrapper's own default "
                   "on this device)")
    p.add_argument("--accumulation", choices=("none", "local", "sharded"), default="none",
                   help="two micro-batches per step, accumulated so (DDP: always "
                   "local; default none)")
    # Three steps missed the fullest: five launches of the same FSDP points
    # (ring N=2, the GPT and MLP 4 x 256, 2026-11-27) peaked up to 26% apart
    # with 3, and three launches with 12 agreed on all but two points.
    p.add_argument("--repeat", type=int, default=10,
                   help="steps measured after the first; the peak is the highest (default 10; "
                   "3 for a quicker look that may miss the fullest step)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--record", metavar="PATH",
                   help="also append each point to a records file, e.g. "
                   "benchmarks/records/plan_memory.jsonl (replan_records.py)")
    args = p.parse_args(argv)
    if args.seq_len > 64 and "gpt" in args.models:
        p.error(f"--seq-len {args.seq_len}: the GPT's position table holds 64; pass at most "
                "64, or --models mlp llama")
    if args.compile and "ddp" in args.modes:
        p.error("--compile measures fsdp_step's whole steps: pass --modes fully_shard and/or "
                "fsdp (ddp_step's compiled update: MLX_FSDP_FUSED_UPDATE=1)")
    return args


def main(argv=None):
    args = parse_args(argv)
    group = mx.distributed.init()
    if args.unpaced:
        pace.QUEUE_DEPTH = 0
    if args.memory_limit is not None:
        mx.set_memory_limit(args.memory_limit)
    rows = [measure(m, o, mode, args, group, reshard == "on")
            for m in args.models for o in args.optimizers for mode in args.modes
            for reshard in (args.reshard_after_forward if mode == "fully_shard" else ["off"])]
    if group.rank() != 0:
        return
    size = args.communication_size
    buckets = "default buckets" if size is None else f"buckets {size / MiB:g} MiB"
    limit = "" if args.memory_limit is None else f", memory limit {args.memory_limit / MiB:g} MiB"
    compiled = (", compiled" if args.compile else "") + (", unpaced" if args.unpaced else "")
    print(f"N={group.size()}, {args.dtype}, {buckets}, accumulation {args.accumulation}, MLP "
          f"{args.layers}x{args.hidden}, GPT/Llama {args.gpt_layers}x{args.dims} on batches of "
          f"{args.batch_size}x{args.seq_len}, fully_shard wraps "
          f"{args.wrap}{compiled}{limit}; bytes of rank 0, equal = on every rank (fully_shard: "
          "parameters and gradients too); peak: max over ranks")
    print("| model | optimizer | mode | state B | masters B | accumulated B | equal | "
          "peak predicted MiB | peak measured MiB | measured / predicted |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        mode = r["mode"] + (" (reshard)" if r["reshard_after_forward"] else "")
        print(f"| {r['model']} | {r['optimizer']} | {mode} | {r['state_measured'][0]} | "
              f"{r['masters_measured'][0]} | {r['accumulation_measured'][0]} | "
              f"{'yes' if r['equal'] else 'NO'} | {r['peak_predicted'] / MiB:.2f} | "
              f"{r['peak_measured'] / MiB:.2f} | {r['peak_measured'] / r['peak_predicted']:.3f} |")
    ratios = [r["peak_predicted"] / r["peak_measured"] for r in rows]
    print(f"predicted / measured: lowest {min(ratios):.3f} (below 1: measured above the "
          f"bound), highest {max(ratios):.3f}")
    # Each rank's plan bounds that rank (ddp_step plans one for all).
    each = [p / m for r in rows
            for p, m in zip(r["peak_predicted_ranks"] * len(r["peak_measured_ranks"]),
                            r["peak_measured_ranks"])]
    print(f"rank by rank: lowest {min(each):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=1)
    if args.record:
        with open(args.record, "a") as f:
            for r in rows:
                f.write(json.dumps(record_of(r, args), separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
