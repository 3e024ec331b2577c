"""``python -m mlx_fsdp.plan_memory``: will it fit, and with how many ranks?

    python -m mlx_fsdp.plan_memory --params 7B --memory 64GiB
    python -m mlx_fsdp.plan_memory path/to/mlx-lm-model --optimizer adamw muon --ranks 2 4
    python -m mlx_fsdp.plan_memory model.safetensors --dtype bfloat16 --json plan.json
"""

import argparse
import json
import re
import sys

from . import optimizers, shapes
from .buffers import DEVICES, default_communication_size, default_device
from .estimate import ACCUMULATION, MODES, estimate_ranks
from .report import Row, describe, fewest_ranks, gib, table, verdicts

#: Backend -> FSDP's reduce-scatter there (see :mod:`mlx_fsdp.collectives`).
BACKENDS = {"ring": None, "mpi": None, "nccl": "native", "jaccl": "native"}

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
        description="Per-rank memory of ddp_step and fsdp_step for a model, before launching.",
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
    g.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES))
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
                   "gradient) or sharded (FSDP: this rank's 1/N)")
    g = p.add_argument_group("output")
    g.add_argument("--memory", type=byte_size,
                   help="memory per rank, e.g. 64GB or 64GiB: say what fits, and how many "
                   "ranks FSDP needs where DDP does not fit")
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
    return p, args


def load_model(p, args) -> shapes.Model:
    if args.model is not None:
        return shapes.load(args.model)
    fields = dict(shapes.PRESETS.get(args.params, {}))
    for key in ("layers", "dims", "ffn", "vocab", "heads", "kv_heads"):
        if getattr(args, key) is not None:
            fields[key] = getattr(args, key)
    missing = [k for k in ("layers", "dims", "ffn", "vocab", "heads") if k not in fields]
    if missing:
        p.error("a description without --params needs " +
                ", ".join("--" + k for k in missing))
    return shapes.llama(**fields, tie=args.tie, dtype=args.dtype or "bfloat16")


def plan(model: shapes.Model, args):
    """Every configuration's rows, and the fewest FSDP ranks per optimizer (with ``--memory``)."""
    options = dict(dtype=args.dtype, communication_size=args.communication_size,
                   accumulation=args.accumulation, device=args.device,
                   reduce_scatter=BACKENDS[args.backend],
                   master_dtype=None if args.master_dtype == "none" else args.master_dtype)
    results = {
        name: [Row(name, mode, n, estimate_ranks(model, name, mode, n, **options))
               for mode in args.mode for n in sorted(set(args.ranks))]
        for name in args.optimizer
    }
    needed = {}
    if args.memory is not None and "fsdp" in args.mode:
        for name in args.optimizer:
            n, why = fewest_ranks(model, name, args.memory, args.max_ranks, **options)
            needed[name] = {"world_size": n, "why": why}
    return results, needed


def render(model: shapes.Model, args, results, needed) -> str:
    """The terminal report: a header, then a table and verdicts per optimizer."""
    first = results[args.optimizer[0]][0].fullest
    dtypes = sorted({a.dtype for a in model.arrays}) if args.dtype is None else [args.dtype]
    out = [
        f"{model.name}: {model.num_parameters / 1e9:.3f}B parameters, "
        f"{len(model.arrays)} arrays, {gib(first.parameters)} GiB ({'/'.join(dtypes)})",
        f"{args.device.upper()}, {args.backend} ({_reduce_scatter(args.backend)}), "
        f"{_buckets(args)}",
        f"masters {args.master_dtype}, accumulation {args.accumulation}"
        + ("" if args.memory is None else f", memory {gib(args.memory)} GiB per rank"),
        "GiB per rank (the fullest rank); peak = the sum: one optimizer step, without "
        "activations and the optimizer's arithmetic temporaries",
    ]
    for name in args.optimizer:
        out += ["", f"{name}: {describe(name)}", table(results[name], args.memory)]
        out += verdicts(results[name], args.memory)
        if name in needed:
            out.append(_needed_line(results[name], needed[name], args.memory))
    return "\n".join(out)


def main(argv=None) -> int:
    p, args = parse_args(argv)
    try:
        model = load_model(p, args)
        results, needed = plan(model, args)
    except ValueError as e:
        p.error(str(e))
    if args.json != "-":
        print(render(model, args, results, needed))
    if args.json:
        record = {
            "model": {"name": model.name, "parameters": model.num_parameters,
                      "arrays": len(model.arrays)},
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "memory": args.memory,
            "rows": [r.to_dict(args.memory) for name in args.optimizer for r in results[name]],
            "fsdp_ranks_needed": needed,
        }
        if args.json == "-":
            print(json.dumps(record, indent=1))
        else:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
    return 0


def _reduce_scatter(backend: str) -> str:
    if BACKENDS[backend] == "native":
        return "native reduce-scatter"
    return "reduce-scatter by exchange at N=2, by all-sum above"


def _buckets(args) -> str:
    """The bucket budgets used: the one given, or each wrapper's default on the device."""
    mib = lambda n: f"{n / 1024**2:g} MiB"  # noqa: E731
    if args.communication_size is not None:
        return f"buckets {mib(args.communication_size)}"
    sizes = {mode: default_communication_size(mode, args.device) for mode in args.mode}
    where = "the CPU" if args.device == "cpu" else "a GPU"
    return ("buckets " + ", ".join(f"{mode.upper()} {mib(n)}" for mode, n in sizes.items())
            + f" (the wrappers' defaults on {where})")


def _needed_line(rows, needed: dict, memory: int) -> str:
    ddp = [str(r.world_size) for r in rows if r.mode == "ddp" and r.fits(memory)]
    n, why = needed["world_size"], needed["why"]
    line = f"In {gib(memory)} GiB: "
    if any(r.mode == "ddp" for r in rows):
        line += f"DDP fits at N={','.join(ddp)}; " if ddp else "DDP does not fit; "
    return line + (f"FSDP fits from N={n}" if n is not None else f"FSDP does not fit: {why}")


if __name__ == "__main__":
    sys.exit(main())
