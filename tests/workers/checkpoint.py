"""Save and resume across world sizes.

Usage:
  checkpoint.py save DIR OPT STEPS COMM WRAP   train STEPS steps (WRAP: fsdp | ddp), save to DIR
  checkpoint.py resume DIR OPT STEPS MORE WRAP load DIR (WRAP: fsdp | ddp | plain), check the
                                               state against a plain run, train MORE steps
  checkpoint.py fail_save DIR                  save over DIR with rank 1's write failing
  checkpoint.py bad_load DIR                   load DIR (damaged by the test): report the errors

Every run uses the global batches of ckpt_common, each rank taking its slice, so
all world sizes follow the same trajectory as a plain single-process run.
"""

import sys

from ckpt_common import by_key_diff, make_optimizer, node, sub_states, train
from common import make_model, report

import mlx.core as mx
from mlx.utils import tree_flatten

import mlx_fsdp
from mlx_fsdp.checkpoint import save

WRAPPERS = {
    "fsdp": lambda o, comm: mlx_fsdp.fsdp_step(o, communication_size=comm),
    "ddp": lambda o, comm: mlx_fsdp.ddp_step(o),
    "plain": lambda o, comm: o,
}


def reference(name, steps):
    """The uninterrupted plain MLX run."""
    model, opt = make_model(bf16=False), make_optimizer(name)
    train(model, opt, steps)
    return model, opt


def state_vs_reference(opt, ref_opt, group):
    """Largest difference between this rank's state and the plain state, cut independently.

    The documented layout (docs/optimizers.md, "State layout"): a flat bucket is its arrays'
    elements back to back (a sharded matrix column by column), zero-padded to
    N * cols; rank r holds elements [r * cols, (r + 1) * cols) and keeps, per
    array, the state of its piece of that range. Owned arrays are held whole
    by their owner.
    """
    rank = group.rank()
    plan = getattr(opt, "plan", None)
    worst = 0.0
    for o, (mine, ref) in enumerate(zip(sub_states(opt), sub_states(ref_opt))):
        if plan is None or not plan.buckets:  # a plain layout: compare whole
            worst = max(worst, by_key_diff(dict(mine), dict(ref)))
            continue
        worst = max(worst, abs(mine["step"].item() - ref["step"].item()))
        for b in plan.buckets:
            if b.optimizer != o:
                continue
            lo, hi = rank * b.cols, (rank + 1) * b.cols
            for s in b.slots:
                begin, end = max(s.start, lo) - s.start, min(s.stop, hi) - s.start
                if (b.owned and s.owner != rank) or (not b.owned and begin >= end):
                    assert s.path not in mine, (s.path, "state on a rank that holds nothing of it")
                    continue
                for name, piece in mine[s.path].items():
                    whole = node(ref, s.path)[name]
                    if not b.owned:
                        whole = (whole.T if whole.ndim == 2 else whole).reshape(-1)[begin:end]
                    assert piece.shape == whole.shape, (s.path, name, piece.shape, whole.shape)
                    worst = max(worst, mx.abs(piece - whole).max().item())
    # The sum over ranks bounds every rank's difference.
    return mx.distributed.all_sum(mx.array(worst), group=group).item()


def main():
    group = mx.distributed.init()
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "save":
        name, steps, comm, wrap = sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
        model = make_model(bf16=False)
        opt = WRAPPERS[wrap](make_optimizer(name), comm)
        train(model, opt, steps, group.rank(), group.size())
        mlx_fsdp.save_checkpoint(path, model, opt, metadata={"note": "test"})
        buckets = len(opt.plan.buckets) if getattr(opt, "plan", None) else 0
        report(group, step=sub_states(opt)[0]["step"].item(), buckets=buckets)
    elif mode == "resume":
        name, steps, more, wrap = sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
        ref_model, ref_opt = reference(name, steps)
        model = make_model(seed=123, bf16=False)  # other weights: the load must replace them
        opt = WRAPPERS[wrap](make_optimizer(name), 32 * 1024**2)
        manifest = mlx_fsdp.load_checkpoint(path, model, opt)
        loaded_weights = by_key_diff(model.parameters(), ref_model.parameters())
        loaded_state = state_vs_reference(opt, ref_opt, group)
        step_after_load = sub_states(opt)[0]["step"].item()
        train(model, opt, more, group.rank(), group.size(), start=steps)
        train(ref_model, ref_opt, more, start=steps)
        report(group, loaded_weights=loaded_weights, loaded_state=loaded_state,
               step_after_load=step_after_load, saved_world=manifest["world_size"],
               user=manifest["user"], final=by_key_diff(model.parameters(), ref_model.parameters()),
               lr=[s["learning_rate"].item() for s in sub_states(opt)],
               ref_lr=[s["learning_rate"].item() for s in sub_states(ref_opt)],
               step=sub_states(opt)[0]["step"].item())
    elif mode == "fail_save":
        model = make_model(bf16=False)
        opt = mlx_fsdp.fsdp_step(make_optimizer("adamw"))
        train(model, opt, 1, group.rank(), group.size())
        if group.rank() == 1:
            def broken(file, arrays):
                with open(file, "wb") as f:
                    f.write(b"half a file")
                raise OSError("disk full (simulated)")
            save._write = broken
        try:
            mlx_fsdp.save_checkpoint(path, model, opt)
            print(f"rank {group.rank()}: NO ERROR\n", end="", flush=True)
        except RuntimeError as e:
            print(f"rank {group.rank()}: RuntimeError: {e}\n", end="", flush=True)
    elif mode == "bad_load":
        model = make_model(bf16=False)
        opt = mlx_fsdp.fsdp_step(make_optimizer("adamw"))
        before = [v for _, v in tree_flatten(model.parameters())]
        try:
            mlx_fsdp.load_checkpoint(path, model, opt)
            print(f"rank {group.rank()}: NO ERROR\n", end="", flush=True)
        except mlx_fsdp.CheckpointError as e:
            print(f"rank {group.rank()}: CheckpointError: {e}\n", end="", flush=True)
        after = [v for _, v in tree_flatten(model.parameters())]
        untouched = all(mx.array_equal(a, b).item() for a, b in zip(before, after))
        print(f"rank {group.rank()}: untouched={untouched} state={len(tree_flatten(opt.state))}\n",
              end="", flush=True)


if __name__ == "__main__":
    main()
