"""``python -m mlx_fsdp.plan_memory``: will it fit, and with how many ranks?

    python -m mlx_fsdp.plan_memory --params 7B --memory 64GiB
    python -m mlx_fsdp.plan_memory path/to/mlx-lm-model --optimizer adamw muon --ranks 2 4
    python -m mlx_fsdp.plan_memory model.safetensors --dtype bfloat16 --json plan.json
    python -m mlx_fsdp.plan_memory --params 8B --fit --ranks 8 --memory 32GiB --mode fully_shard
"""

import argparse
import json
import re
import sys
from typing import Optional

import mlx.core as mx

from . import fit, optimizers, shapes
from .buffers import BACKENDS, DEVICES, default_device
from .estimate import ACCUMULATION, MODES, estimate_ranks
from .fully import WRAPS
from .render import render, render_fit
from .activations import activation_bytes, llama_shape, pass_of
from .lora import adapter_activations, with_lora
from .report import Row, dominant, fewest_ranks, largest_batch

_SIZE = re.compile(r"([0-9]*\.?[0-9]+)\s*(?:([kmgt])(?:i?b)?|b?)", re.IGNORECASE)


def byte_size(text: str) -> int:
    """A byte count: ``64GB``, ``64GiB``, ``64G``, ``1.5TB``, ``32MiB`` or plain bytes.

    Units are binary, with or without the ``i``, as memory is sold (a "64GB"
    machine has 64 * 2^30 bytes).
    """
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write e.g. 64GB or 64GiB (both 64 * 2^30 "
            "bytes), 32MiB, or a number of bytes."
        )
    prefix = (m.group(2) or "").lower()
    return int(float(m.group(1)) * 1024 ** (" kmgt".index(prefix) if prefix else 0))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m mlx_fsdp.plan_memory",
        description="Per-rank memory of ddp_step, fsdp_step and fully sharded training "
        "(fully_shard + fsdp_step) for a model, before launching.",
    )
    p.add_argument("model", nargs="?",
                   help="an mlx-lm model directory (config.json + *.safetensors) or a "
                   ".safetensors file; or leave it out and describe a Llama-style model")
    g = p.add_argument_group("Llama-style shape description (without MODEL)")
    g.add_argument("--params", choices=sorted(shapes.PRESETS),
                   help="a preset: 7B, 13B, 70B (Llama 2), 8B (Llama 3); the flags "
                   "below override its fields")
    for flag, what in (("layers", "decoder layers"), ("dims", "model width"),
                       ("ffn", "MLP hidden width"), ("vocab", "vocabulary size"),
                       ("heads", "attention heads"), ("kv-heads", "key/value heads")):
        g.add_argument(f"--{flag}", type=int, help=what)
    g.add_argument("--tie", action="store_true", help="the output head shares the embedding")
    g = p.add_argument_group("training configuration")
    g.add_argument("--optimizer", nargs="+", choices=list(optimizers.OPTIMIZERS),
                   default=list(optimizers.OPTIMIZERS), help="default: all")
    g.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES),
                   help="ddp (ddp_step), fsdp (fsdp_step), fully_shard (fully_shard and "
                   "fsdp_step) (default: all)")
    g.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="world sizes (default 1 2 4 8)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="parameter dtype (default: as stored; bfloat16 for a description)")
    g.add_argument("--master-dtype", choices=("float32", "none"), default="float32",
                   help="master copies of parameters of another dtype (default float32)")
    g.add_argument("--communication-size", type=byte_size,
                   help="bucket budget, e.g. 32MiB (default: each wrapper's own on --device: "
                   "fsdp_step 4 MiB on the CPU and 32 MiB on a GPU, ddp_step 32 MiB)")
    g.add_argument("--device", choices=DEVICES, default=default_device(),
                   help=f"where the ranks train (default: {default_device()}, MLX's default here)")
    g.add_argument("--backend", choices=tuple(BACKENDS), default="ring",
                   help="the ranks' mx.distributed backend: nccl and jaccl reduce-scatter "
                   "natively, ring and mpi by an exchange (N=2) or an all-sum (default ring)")
    g.add_argument("--accumulation", choices=ACCUMULATION, default="none",
                   help="gradient accumulation buffer: none (default), local (a full "
                   "gradient; FSDP compiled whole: as sharded) or sharded (FSDP: this "
                   "rank's 1/N)")
    g.add_argument("--keeps-old-parameters", action="store_true",
                   help="the training loop keeps a reference to the parameters across "
                   "opt.update, so fsdp_step's gathers come beside them (default: a plain loop)")
    g.add_argument("--max-norm", type=float, metavar="NORM",
                   help="the wrapper's max_norm: the gradients are clipped by their global "
                   "norm, and its copies counted (default: no clipping)")
    g.add_argument("--fine-tune-type", choices=("full", "lora"), default="full",
                   help="full: train every parameter; lora: freeze the model and train "
                   "adapters in its last --num-layers blocks, as mlx_lm.lora (default full)")
    g.add_argument("--num-layers", type=int, default=16,
                   help="lora: blocks with adapters, -1 for all (mlx-lm's default 16)")
    g.add_argument("--lora-rank", type=int, default=8,
                   help="lora: the adapters' rank (mlx-lm's default 8)")
    g = p.add_argument_group("activations (a Llama-style description or mlx-lm directory)")
    g.add_argument("--batch-size", type=int, default=0,
                   help="sequences per rank and step, as mlx-lm's --batch-size (default 0: "
                   "no activations counted)")
    g.add_argument("--seq-len", type=int, default=2048,
                   help="tokens per sequence, as mlx-lm's --max-seq-length (default 2048)")
    g.add_argument("--grad-checkpoint", action="store_true",
                   help="mx.checkpoint around every block, as mlx-lm's --grad-checkpoint")
    g = p.add_argument_group("fully sharded training (--mode fully_shard)")
    g.add_argument("--wrap", choices=WRAPS, default="blocks",
                   help="blocks: fully_shard each block (the module at a path's first "
                   "integer, e.g. model.layers.3), then the model; model: the whole model "
                   "once (default blocks)")
    g.add_argument("--reshard-after-forward", action="store_true",
                   help="the blocks' reshard_after_forward: one block's parameters gathered "
                   "at a time, not all of them between the forward and the backward pass")
    g.add_argument("--compiled", action="store_true",
                   help="the step is compiled whole with mx.compile, as mlx-lm's trainer "
                   "runs it: the update compiled with it; on the CPU fsdp_step holds two of "
                   "its largest bucket's vectors more than eager, and fully_shard's pass, "
                   "apart from its update at N=2, what an unpaced one does (as measured on "
                   "the CPU)")
    g = p.add_argument_group("output")
    g.add_argument("--memory", type=byte_size,
                   help="memory per rank, e.g. 64GB or 64GiB: say what fits, and how many "
                   "ranks FSDP and fully_shard need")
    g.add_argument("--fit", action="store_true",
                   help="with --memory and a shape description: the largest model of that "
                   "width (the most layers) that fits at each --ranks, per mode")
    g.add_argument("--max-ranks", type=int, default=1024,
                   help="largest world size to look for (default 1024)")
    g.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': stdout only)")
    args = p.parse_args(argv)
    described = args.params or any(getattr(args, k) is not None for k in
                                    ("layers", "dims", "ffn", "vocab", "heads", "kv_heads"))
    if (args.model is None) == (not described):
        p.error("give a model directory or .safetensors file, or a shape description "
                "(--params 7B, or --layers/--dims/--ffn/--vocab/--heads), not both")
    if min(args.ranks) < 1 or args.max_ranks < 1:
        p.error(f"--ranks {args.ranks} and --max-ranks {args.max_ranks} must be >= 1")
    if args.batch_size < 0 or args.seq_len < 1:
        p.error(f"--batch-size {args.batch_size} must be >= 0 and --seq-len {args.seq_len} "
                ">= 1; pass the sizes you train with")
    if args.fit and (args.memory is None or args.model is not None or args.layers is not None):
        p.error("--fit grows the layer count of a shape description: give --memory and "
                "--params (or --dims/--ffn/--vocab/--heads), without MODEL and --layers")
    return p, args


def shape_fields(p, args) -> dict:
    """The Llama-style description's fields (``layers`` left out under ``--fit``)."""
    fields = dict(shapes.PRESETS.get(args.params, {}))
    for key in ("layers", "dims", "ffn", "vocab", "heads", "kv_heads"):
        if getattr(args, key) is not None:
            fields[key] = getattr(args, key)
    if args.fit:  # --fit chooses the layer count
        fields.pop("layers", None)
    missing = [k for k in ("dims", "ffn", "vocab", "heads") + (() if args.fit else ("layers",))
               if k not in fields]
    if missing:
        p.error("a description without --params needs " +
                ", ".join("--" + k for k in missing))
    return dict(fields, tie=args.tie, dtype=args.dtype or "bfloat16")


def load_model(p, args) -> shapes.Model:
    model = shapes.load(args.model) if args.model is not None else \
        shapes.llama(**shape_fields(p, args))
    return fine_tuned(args)(model)


def fine_tuned(args):
    """``model -> model`` as ``--fine-tune-type`` trains it."""
    if args.fine_tune_type == "full":
        return lambda model: model
    return lambda model: with_lora(model, args.lora_rank, args.num_layers)


def activations_of(model: shapes.Model, args, mode: str, reshard: Optional[bool] = None,
                   world_size: int = 2):
    """``batch -> activation bytes`` of ``model`` (a Llama-style model) at ``--seq-len``
    in ``mode`` on ``world_size`` ranks: checkpointed per block with
    ``--grad-checkpoint``, or where fully_shard's blocks recompute theirs, and
    paced as ``--device`` and ``--backend`` pace them (:func:`pass_of`).
    ``reshard``: the blocks' reshard_after_forward (``None``:
    ``--reshard-after-forward``)."""
    shape = llama_shape(model)
    dtype = args.dtype or sorted(a.dtype for a in model.arrays)[0]
    size = getattr(mx, dtype).size
    reshard = args.reshard_after_forward if reshard is None else reshard
    how = pass_of(mode, args.wrap, reshard, args.compiled, args.device, args.grad_checkpoint,
                  args.backend, world_size)
    return lambda batch: activation_bytes(shape, batch, args.seq_len, size,
                                          device=args.device, **how) + \
        adapter_activations(model, batch, args.seq_len, size)


def options_of(args) -> dict:
    """The keyword arguments of :func:`estimate_ranks` the flags set."""
    return dict(dtype=args.dtype, communication_size=args.communication_size,
                accumulation=args.accumulation, device=args.device,
                reduce_scatter=BACKENDS[args.backend],
                master_dtype=None if args.master_dtype == "none" else args.master_dtype,
                wrap=args.wrap, reshard_after_forward=args.reshard_after_forward,
                compiled=args.compiled, keeps_old_parameters=args.keeps_old_parameters,
                max_norm=args.max_norm)


def plan(model: shapes.Model, args):
    """Every configuration's rows, the fewest ranks per sharded mode and optimizer (with
    ``--memory``), and fully_shard at the largest N with reshard_after_forward (where it
    is off and every block is wrapped)."""
    options = options_of(args)

    def at(mode: str, reshard: Optional[bool] = None, n: Optional[int] = None) -> dict:
        """The options with ``mode``'s activations at N = ``n`` (``None``: any N)."""
        if not args.batch_size:
            return options
        def acts(world_size: int) -> int:
            return activations_of(model, args, mode, reshard, world_size)(args.batch_size)
        return dict(options, activations=acts if n is None else acts(n))

    results = {
        name: [Row(name, mode, n, estimate_ranks(model, name, mode, n, **at(mode, n=n)))
               for mode in args.mode for n in sorted(set(args.ranks))]
        for name in args.optimizer
    }
    needed = {}
    sharded = [m for m in args.mode if m != "ddp"] if args.memory is not None else []
    for mode in sharded:
        for name in args.optimizer:
            n, why = fewest_ranks(model, name, args.memory, args.max_ranks, mode, **at(mode))
            needed.setdefault(mode, {})[name] = {"world_size": n, "why": why}
            if n is not None:
                rank = Row(name, mode, n,
                           estimate_ranks(model, name, mode, n, **at(mode, n=n))).fullest
                needed[mode][name]["dominates"] = dominant(rank)
            if args.batch_size:
                largest_at = max(args.ranks)
                needed[mode][name]["largest_batch"] = (largest_at, largest_batch(
                    model, name, mode, largest_at, args.memory,
                    activations_of(model, args, mode, world_size=largest_at), **options))
    resharded = {}
    if "fully_shard" in args.mode and args.wrap == "blocks" and not args.reshard_after_forward:
        n = max(args.ranks)
        options_r = dict(at("fully_shard", True, n), reshard_after_forward=True)
        resharded = {name: Row(name, "fully_shard", n,
                               estimate_ranks(model, name, "fully_shard", n, **options_r))
                     for name in args.optimizer}
    return results, needed, resharded


def main(argv=None) -> int:
    p, args = parse_args(argv)
    try:
        if args.fit:
            fields = shape_fields(p, args)
            acts = (lambda m, mode, n: activations_of(m, args, mode, world_size=n)(
                args.batch_size)) \
                if args.batch_size else None
            fits = fit.search(fields, args.optimizer, args.mode, args.ranks, args.memory,
                              activations=acts, transform=fine_tuned(args),
                              **options_of(args))
        else:
            model = load_model(p, args)
            results, needed, resharded = plan(model, args)
    except ValueError as e:
        p.error(str(e))
    if args.json != "-":
        print(render_fit(fields, args, fits) if args.fit else
              render(model, args, results, needed, resharded))
    if args.json:
        record = {"config": {k: v for k, v in vars(args).items() if k != "json"},
                  "memory": args.memory}
        if args.fit:
            record["fit"] = [fit.to_dict(f, args.memory) for name in args.optimizer
                             for f in fits[name]]
        else:
            record.update(
                model={"name": model.name, "parameters": model.num_parameters,
                       "arrays": len(model.arrays)},
                rows=[r.to_dict(args.memory) for name in args.optimizer for r in results[name]],
                fsdp_ranks_needed=needed.get("fsdp", {}),
                fully_shard_ranks_needed=needed.get("fully_shard", {}))
        if args.json == "-":
            print(json.dumps(record, indent=1))
        else:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
