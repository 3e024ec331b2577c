"""Checkpoints of fully sharded models (mlx_fsdp.fully_shard) across world sizes.

Usage:
  ckpt_fully_sharded.py save DIR CONFIG:NAME ...   train each CONFIG STEPS steps, save to DIR/NAME;
                                                   try the last with its bare optimizer
  ckpt_fully_sharded.py resume DIR SRC:CONFIG[:NAME] ...
                                  load DIR/SRC into a fresh CONFIG, compare it with the plain
                                  reference, save it again to DIR/NAME (if given), train MORE
                                  steps and compare again

A CONFIG (see CONFIGS) is an optimizer of ckpt_common and a way to wrap the
OddModel of common.py with fully_shard. Every run takes its slice of
ckpt_common's global batches, so at any world size it follows the plain
single-process run (the reference); "master" (a bfloat16 model with float32
masters) is compared with the checkpoints it saves instead.
"""

import sys

import mlx.core as mx

try:  # as a worker script, or imported by the tests as workers.ckpt_fully_sharded
    from ckpt_common import by_key_diff, make_optimizer, node, sub_states, train
    from common import make_model, report
except ImportError:
    from workers.ckpt_common import by_key_diff, make_optimizer, node, sub_states, train
    from workers.common import make_model, report

import mlx_fsdp
from mlx_fsdp.sharded_state import held_shapes

STEPS, MORE = 3, 2

#: name: (optimizer, wrapping, wrapper)
CONFIGS = {
    "adamw": ("adamw", "nested", "fsdp"),     # inp, wide, out wrapped, then the root
    "root": ("adamw", "root", "fsdp"),        # the root only
    "muon": ("muon", "owner", "fsdp"),        # inp, wide, out with placement=optimizer only
    "plain": ("adamw", "none", "fsdp"),       # fsdp_step without fully_shard
    "ddp": ("adamw", "none", "ddp"),
    "single": ("adamw", "none", "none"),      # the plain optimizer (one process)
    "single_muon": ("muon", "none", "none"),
    "master": ("adamw", "nested", "master"),  # bfloat16 with float32 masters
}


def build(config: str, seed: int = 0):
    name, wrapping, wrapper = CONFIGS[config]
    model, inner = make_model(seed=seed, bf16=False), make_optimizer(name)
    if wrapper == "master":
        model.set_dtype(mx.bfloat16)
    if wrapping in ("nested", "owner"):
        place = inner if wrapping == "owner" else None
        for layer in ("inp", "wide", "out"):
            setattr(model, layer, mlx_fsdp.fully_shard(getattr(model, layer), placement=place,
                                                       reshard_after_forward=layer == "inp"))
    if wrapping in ("nested", "root"):
        model = mlx_fsdp.fully_shard(model)
    opt = {"fsdp": lambda: mlx_fsdp.fsdp_step(inner, communication_size=400),
           "master": lambda: mlx_fsdp.fsdp_step(inner, master_dtype=mx.float32),
           "ddp": lambda: mlx_fsdp.ddp_step(inner),
           "none": lambda: inner}[wrapper]()
    return model, opt


def reference(config: str, steps: int):
    """The uninterrupted plain MLX run: one process, global batches."""
    model, opt = make_model(bf16=False), make_optimizer(CONFIGS[config][0])
    train(model, opt, steps)
    return model, opt


def expected_held(b, s, whole, rank, n):
    """What ``rank`` should hold of ``whole``, by the documented rules, or None.

    fully_shard's rows: rank r holds rows [r*k, min((r+1)*k, R)), k = ceil(R/N)
    (a scalar is one row); owned arrays are whole on their owner; a flat bucket
    piece is elements [r*cols, (r+1)*cols) of the bucket (a matrix column by column).
    """
    if b.owned:
        return whole if s.owner == rank else None
    if b.by_rows:
        rows = whole.shape[0] if whole.ndim else 1
        k = -(-rows // n)
        lo, hi = min(rank * k, rows), min(rank * k + k, rows)
        return None if hi <= lo else (whole[lo:hi] if whole.ndim else whole)
    lo, hi = rank * b.cols, (rank + 1) * b.cols
    begin, end = max(s.start, lo) - s.start, min(s.stop, hi) - s.start
    return None if begin >= end else (whole.T if whole.ndim == 2 else whole).reshape(-1)[begin:end]


def state_vs_reference(opt, ref_opt, group):
    """Largest difference, over all ranks, between what each holds and the plain state."""
    rank, n = group.rank(), group.size()
    if not isinstance(opt, mlx_fsdp.ShardedOptimizer) or n == 1:
        return max(by_key_diff(dict(a), dict(b))
                   for a, b in zip(sub_states(opt), sub_states(ref_opt)))
    worst = 0.0
    for o, (mine, ref) in enumerate(zip(sub_states(opt), sub_states(ref_opt))):
        worst = max(worst, abs(mine["step"].item() - ref["step"].item()))
        for b in opt.plan.buckets:
            for s in b.slots if b.optimizer == o else ():
                plain = s.path.replace("module.", "")  # no OddModel name contains "module"
                entries = node(ref, plain)
                for name, whole in entries.items():
                    want = expected_held(b, s, whole, rank, n)
                    have = mine.get(s.path, {}).get(name)
                    assert (have is None) == (want is None), (s.path, name, rank)
                    if have is not None:
                        assert have.shape == want.shape, (s.path, name, have.shape, want.shape)
                        worst = max(worst, mx.abs(have - want).max().item())
    return mx.distributed.all_sum(mx.array(worst), group=group).item()


def save(directory, cases, group):
    for case in cases:
        config, name = case.split(":")
        model, opt = build(config)
        train(model, opt, STEPS, group.rank(), group.size())
        mlx_fsdp.save_checkpoint(f"{directory}/{name}", model, opt, metadata={"config": config})
    # A fully sharded model with an optimizer that is not its fsdp_step: refused on every rank.
    refused = []
    for call in (mlx_fsdp.save_checkpoint, mlx_fsdp.load_checkpoint):
        try:
            call(f"{directory}/{name}", model, opt.optimizer)
            refused.append("NO ERROR")
        except ValueError as e:
            refused.append(f"{type(e).__name__}: {e}")
    report(group, saved=cases, refused=refused)


def resume(directory, cases, group):
    out = {}
    for case in cases:
        src, config, *save_as = case.split(":")
        model, opt = build(config, seed=123)  # other weights: the load must replace them
        manifest = mlx_fsdp.load_checkpoint(f"{directory}/{src}", model, opt)
        r = {"saved_world": manifest["world_size"], "step": sub_states(opt)[0]["step"].item()}
        if CONFIGS[config][2] == "master":
            held = held_shapes(opt.plan, group.rank(), 0)
            masters = opt.state["master"]
            ok = set(masters) == set(held) and all(tuple(masters[p].shape) == tuple(held[p])
                                                    for p in held)
            r["masters_held"] = mx.distributed.all_sum(mx.array(int(ok)), group=group).item()
        else:
            ref_model, ref_opt = reference(config, STEPS)
            r["loaded_weights"] = by_key_diff(mlx_fsdp.full_parameters(model),
                                              ref_model.parameters())
            r["loaded_state"] = state_vs_reference(opt, ref_opt, group)
        if save_as:
            mlx_fsdp.save_checkpoint(f"{directory}/{save_as[0]}", model, opt)
        if CONFIGS[config][2] != "master":
            train(model, opt, MORE, group.rank(), group.size(), start=STEPS)
            train(ref_model, ref_opt, MORE, start=STEPS)
            r["final"] = by_key_diff(mlx_fsdp.full_parameters(model), ref_model.parameters())
            r["lr"] = [s["learning_rate"].item() for s in sub_states(opt)]
            r["ref_lr"] = [s["learning_rate"].item() for s in sub_states(ref_opt)]
        out[case] = r
    report(group, **out)
    return out


def main():
    group = mx.distributed.init()
    mode, directory, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
    {"save": save, "resume": resume}[mode](directory, cases, group)


if __name__ == "__main__":
    main()
