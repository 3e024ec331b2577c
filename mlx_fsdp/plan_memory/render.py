"""What the planner prints: the header, a table and verdicts per optimizer, or the largest fits."""

from . import fit, shapes
from .buffers import BACKENDS, default_communication_size
from .estimate import shape_only
from .fully import BLOCKS_ALIVE
from .phases import phases_apart
from .report import LABELS, describe, gib, table, verdicts


def render(model: shapes.Model, args, results, needed, resharded) -> str:
    """The terminal report: a header, then a table and verdicts per optimizer."""
    # The whole model's bytes (the first row may be a rank's shard of it).
    _, total = shape_only(model, args.dtype)
    dtypes = sorted({a.dtype for a in model.arrays}) if args.dtype is None else [args.dtype]
    out = [
        f"{model.name}: {model.num_parameters / 1e9:.3f}B parameters, "
        f"{len(model.arrays)} arrays, {gib(total)} GiB ({'/'.join(dtypes)})",
        f"{args.device.upper()}, {args.backend} ({_reduce_scatter(args.backend)}), "
        f"{_buckets(args)}",
        f"masters {args.master_dtype}, accumulation {args.accumulation}" + _loop(args)
        + ("" if args.memory is None else f", memory {gib(args.memory)} GiB per rank"),
    ] + header_tail(args)
    for name in args.optimizer:
        out += ["", f"{name}: {describe(name)}", table(results[name], args.memory)]
        out += verdicts(results[name], args.memory) + compare(
            results[name], resharded.get(name), BLOCKS_ALIVE[args.device], args.memory)
        if needed:
            out.append(_needed_line(results[name], needed, name, args.memory))
    return "\n".join(out)


def _loop(args) -> str:
    """What the header says of the clipping (--max-norm) and of a loop that keeps its old
    parameters (--keeps-old-parameters)."""
    clip = "" if args.max_norm is None else f", clipped to a norm of {args.max_norm:g}"
    return clip + (", a loop that keeps its old parameters" if args.keeps_old_parameters else "")


def header_tail(args) -> list:
    """The header's last lines: how fully_shard wraps the model, and what the columns are."""
    out = []
    if "fully_shard" in args.mode:
        how = ("every block (the module at a path's first integer, e.g. model.layers.3) "
               "and the rest of the model" if args.wrap == "blocks" else "the whole model once")
        out.append(f"fully_shard: {how}; reshard_after_forward "
                   f"{'on' if args.reshard_after_forward else 'off'}"
                   + ("; the step compiled whole"
                      if getattr(args, "compiled", False) else ""))
    out.append("GiB per rank (the fullest rank); peak = the sum: one optimizer step"
               + (" or fully_shard's forward and backward pass (gathered, full grads), "
                  "whichever is fuller," if "fully_shard" in args.mode else ",")
               + " temporaries (temps) and activations (acts) included"
               + (" (fully_shard: the pass with the acts, the update with the temps, as the "
                  "update waits for the pass here)" if "fully_shard" in args.mode
                  and phases_apart(args.device, getattr(args, "compiled", False)) else "")
               + (" (fsdp: the step, or the pass with the acts, the fuller, as its update "
                  "waits for the pass here)" if "fsdp" in args.mode and args.device == "cpu"
                  and getattr(args, "batch_size", 0) else "")
               + ": an upper bound"
               + (f"; activations of batch {args.batch_size} x {args.seq_len} tokens"
                  + (" with mx.checkpoint per block" if args.grad_checkpoint else
                     "; fully_shard's resharded blocks recompute theirs, counted as under "
                     "mx.checkpoint" if "fully_shard" in args.mode and args.wrap == "blocks"
                     else "")
                  + ("; on a GPU with what MLX queues ahead, less where collectives the CPU "
                     "runs cut fully_shard's pass" if args.device == "gpu" else "")
                  if getattr(args, "batch_size", 0) else "; no batch given (--batch-size)"))
    return out


def compare(rows, resharded=None, blocks_alive: int = 1, memory=None) -> list:
    """What fully sharding saves at the largest N: parameters, against fsdp_step; and
    what ``resharded`` (that N with reshard_after_forward) gathers, ``blocks_alive``
    blocks at once, and whether it fits ``memory``."""
    by = {(r.mode, r.world_size): r.fullest for r in rows}
    n = max(r.world_size for r in rows)
    if ("fully_shard", n) not in by or n == 1:
        return []
    fs = by["fully_shard", n]
    # (Not its gradients: they come as its gathers go, so the pass at its
    # fullest may hold only some of them.)
    line = f"fully_shard at N={n}: parameters {gib(fs.parameters)} GiB per rank"
    if ("fsdp", n) in by:
        line += f" (fsdp_step: {gib(by['fsdp', n].parameters)})"
    if fs.gathered:
        line += f", plus {gib(fs.gathered)} GiB gathered at once"
    out = [line]
    if resharded is not None:
        r = resharded.fullest
        at_once = (f"{blocks_alive} blocks gathered at once, as MLX runs ahead" if blocks_alive > 1
                   else "1 block gathered at once, evaluation paced on the CPU")
        out.append(f"  with --reshard-after-forward (the root and {at_once}): "
                   f"gathered {gib(r.gathered)} GiB, peak {gib(r.peak)} GiB"
                   + ("" if memory is None else
                      f" ({'fits' if r.peak <= memory else 'does not fit'} {gib(memory)} GiB)"))
    return out


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
    return ("buckets " + ", ".join(f"{LABELS[mode]} {mib(n)}" for mode, n in sizes.items())
            + f" (the wrappers' defaults on {where})")


def _needed_line(rows, needed: dict, name: str, memory: int) -> str:
    ddp = [str(r.world_size) for r in rows if r.mode == "ddp" and r.fits(memory)]
    parts = []
    if any(r.mode == "ddp" for r in rows):
        parts.append(f"DDP fits at N={','.join(ddp)}" if ddp else "DDP does not fit")
    for mode, by_name in needed.items():
        n, why = by_name[name]["world_size"], by_name[name]["why"]
        entry = by_name[name]
        parts.append(f"{LABELS[mode]} fits from N={n} ({entry['dominates']} dominates)"
                     if n is not None else f"{LABELS[mode]} does not fit: {why}")
        if "largest_batch" in entry:
            at, batch = entry["largest_batch"]
            parts[-1] += f", largest batch at N={at}: {batch}"
    return f"In {gib(memory)} GiB: " + "; ".join(parts)


def render_fit(fields: dict, args, fits: dict) -> str:
    """The largest model per optimizer, mode and N: its layers, parameters and breakdown."""
    # The width as shapes.llama names it, without its layer count.
    width = shapes.llama(layers=1, **fields).name.replace(", 1 layers", "")
    out = [
        f"Largest {width}{' (tied head)' if fields['tie'] else ''} in {gib(args.memory)} GiB "
        f"per rank, the layer count grown: {fields['dtype']}, "
        f"{fit.layer_parameters(fields) / 1e6:.1f}M parameters a layer",
        f"{args.device.upper()}, {args.backend} ({_reduce_scatter(args.backend)}), "
        f"{_buckets(args)}",
        f"masters {args.master_dtype}, accumulation {args.accumulation}" + _loop(args),
    ] + header_tail(args)
    for name in args.optimizer:
        found = fits[name]
        lead = (["layers", "parameters"],
                [[(">=" if f.at_least else "") + str(f.layers),
                  _count(f.parameters) if f.layers else "-"] for f in found])
        out += ["", f"{name}: {describe(name)}",
                table([f.row for f in found], args.memory, lead)]
        for n in sorted({f.row.world_size for f in found}):
            parts = [f"{LABELS[f.row.mode]} " + (
                f"{f.layers} layer{'s' * (f.layers > 1)}, {_count(f.parameters)} parameters"
                if f.layers else f"not one layer ({gib(f.row.fullest.peak)} GiB)")
                for f in found if f.row.world_size == n]
            out.append(f"N={n}: " + "; ".join(parts))
    return "\n".join(out)


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.1f}M"
