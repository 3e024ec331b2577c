"""mlx-lm's trainer with a sharded optimizer, sharded checkpoints and resume."""

import dataclasses
import json
import os
from contextlib import contextmanager
from typing import Optional

import mlx.core as mx

from ..ddp import ddp_step
from ..fsdp import fsdp_step
from ..fully_sharded.model import sharded_modules
from ..wrapper import DistributedOptimizer
from . import checkpoints
from .hooks import trainer_all_reduce_removed
from .position import ResumableBatches
from .sharding import check_options, save_adapters, shard_model, unshard_model


def _wrap(optimizer, fsdp: bool, options: dict):
    if isinstance(optimizer, DistributedOptimizer):
        if options:
            raise ValueError(
                f"optimizer is already an mlx_fsdp wrapper, so {sorted(options)} cannot "
                "apply; pass the plain optimizer, or no wrapper options."
            )
        return optimizer
    return (fsdp_step if fsdp else ddp_step)(optimizer, **options)


@contextmanager
def sharded_training(optimizer, *, fsdp: bool = True, **options):
    """Hand ``mlx_lm.tuner.trainer.train`` a sharded optimizer, without its all-reduce.

    mlx-lm's trainer averages the gradients itself before
    ``optimizer.update``; an :func:`~mlx_fsdp.fsdp_step` optimizer reduces
    them again (a reduce-scatter), so the trainer's all-reduce is pure
    overhead. Inside this block it is off (see
    :func:`mlx_fsdp.lm.hooks.trainer_all_reduce_removed`); on exit mlx-lm is
    as it was.

    .. code-block:: python

        from mlx_lm.tuner.trainer import TrainingArgs, train
        with mlx_fsdp.lm.sharded_training(optim.AdamW(learning_rate=1e-5), max_norm=1.0) as opt:
            train(model, opt, train_set, val_set, args=TrainingArgs(iters=1000))

    Train only with the optimizer it yields inside the block: a plain
    optimizer there gets no gradient averaging at all.

    Args:
        optimizer (mlx.optimizers.Optimizer): The optimizer to wrap, or an
            :func:`~mlx_fsdp.fsdp_step` / :func:`~mlx_fsdp.ddp_step` wrapper
            (used as it is; then give no ``options``).
        fsdp (bool): Wrap with :func:`~mlx_fsdp.fsdp_step` (sharded state);
            ``False`` wraps with :func:`~mlx_fsdp.ddp_step` (replicated).
            Default: ``True``.
        **options: Keyword arguments of the wrapper, e.g. ``max_norm``,
            ``communication_size``, ``master_dtype``.

    Yields:
        The wrapped optimizer.
    """
    wrapped = _wrap(optimizer, fsdp, options)
    with trainer_all_reduce_removed():
        yield wrapped


def _plain(info: dict) -> dict:
    return {k: v.item() if isinstance(v, mx.array) else v for k, v in info.items()}


class _Reports:
    """Passes mlx-lm's reports on with run-wide iteration numbers; logs them as JSON lines.

    A resumed ``train`` call counts its iterations from 1; the reports carry
    ``start`` more. Rank 0 appends one line per report to ``log_file``.
    """

    def __init__(self, callback, start: int, log_file: Optional[str], rank: int):
        self.callback = callback
        self.start = start
        self.log_file = log_file if rank == 0 else None
        if self.log_file:
            _trim_log(self.log_file, start)

    def _report(self, kind: str, info: dict):
        info = dict(info, iteration=info["iteration"] + self.start)
        if self.log_file:
            with open(self.log_file, "a") as fh:
                fh.write(json.dumps({"kind": kind, **_plain(info)}) + "\n")
        method = getattr(self.callback, f"on_{kind}_loss_report", None)
        if method is not None:
            method(info)

    def on_train_loss_report(self, info: dict):
        self._report("train", info)

    def on_val_loss_report(self, info: dict):
        self._report("val", info)


def _trim_log(path: str, start: int):
    # Keep what happened up to the checkpoint (all of it on a fresh start: start=0
    # keeps nothing). A validation reported at iteration s ran after step s.
    kept = []
    if start and os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                r = json.loads(line)
                if r["iteration"] < start or (r["kind"] == "train" and r["iteration"] == start):
                    kept.append(line)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        fh.writelines(kept)


def train(model, optimizer, train_dataset, val_dataset=None, args=None, loss=None,
          iterate_batches=None, training_callback=None, *, fsdp: bool = True,
          fully_shard: bool = False, reshard_after_forward: bool = False,
          accumulation: str = "local", checkpoint_dir: Optional[str] = None,
          resume: bool = False, log_file: Optional[str] = None, unshard: bool = True,
          **options):
    """``mlx_lm.tuner.trainer.train`` with a sharded optimizer, checkpoints and resume.

    Takes ``train``'s arguments and calls it inside :func:`sharded_training`,
    so the losses are those of mlx-lm's own data-parallel run, with 1/N of
    the optimizer state per rank and no second all-reduce. It also

    - writes ``adapters.safetensors`` and ``{iteration:07d}_adapters.safetensors``
      every ``args.steps_per_save`` iterations (rank 0), as mlx-lm's trainer
      does, numbered by the iteration of the whole run also after a resume;
    - with ``checkpoint_dir``, saves a sharded checkpoint (every rank) at the
      same iterations and at the end, to ``checkpoint_dir/step-{iteration:07d}``;
    - with ``resume``, continues from the latest of them, at this or another
      number of ranks: the model, the optimizer state and step (so the
      schedule), MLX's random key and mlx-lm's batch order (see
      :mod:`mlx_fsdp.lm.position`); ``args.iters`` is the iteration the whole
      run ends at.

    Args:
        model, optimizer, train_dataset, val_dataset, args, loss,
        iterate_batches, training_callback: As for mlx-lm's ``train`` (its
            defaults when ``None``). ``optimizer`` is a plain
            ``mlx.optimizers`` optimizer, or a wrapper.
        fsdp (bool): Shard the optimizer (``fsdp_step``); ``False`` replicates
            it (``ddp_step``). Default: ``True``.
        fully_shard (bool): Also shard the parameters: wrap each block of
            ``model.layers``, then the model, with :func:`mlx_fsdp.fully_shard`
            for the run (see :mod:`mlx_fsdp.lm.sharding`; at the end, ``unshard``).
            Each rank saves only its shards to ``checkpoint_dir``; a run resumes
            from them, or from a checkpoint saved without ``fully_shard``, with
            or without it (see :mod:`mlx_fsdp.lm.checkpoints`). Needs ``fsdp``.
            Default: ``False``.
        reshard_after_forward (bool): With ``fully_shard``: free each block's
            gathered parameters after its forward pass and recompute the
            block in the backward pass. ``args.grad_checkpoint`` implies it
            with ``fully_shard``. Default: ``False``.
        accumulation (str): With ``args.grad_accumulation_steps > 1``:
            ``"local"`` lets mlx-lm's trainer sum full gradients and hand the
            optimizer their mean every k-th micro-batch; ``"sharded"`` hands
            every micro-batch to ``fsdp_step(grad_accumulation_steps=k,
            accumulation="sharded")``, which keeps 1/N of the sum per rank
            (k reductions per step instead of one). Default: ``"local"``.
        checkpoint_dir (str, optional): Where to save checkpoints. Default:
            ``None`` (none saved).
        resume (bool): Continue from the latest checkpoint in
            ``checkpoint_dir``. Default: ``False``.
        log_file (str, optional): Rank 0 appends every loss report to it as a
            JSON line (``{"kind": "train" | "val", "iteration": ..., ...}``); on
            resume, lines after the checkpoint are dropped first. Default: ``None``.
        unshard (bool): With ``fully_shard``: put the whole trained parameters
            back into ``model``, unwrapped, on every rank at the end; or return
            the sharded model, never whole on any rank. Default: ``True``.

    Returns:
        mlx.nn.Module: ``model``, or its sharded wrapper (``unshard=False``).
        **options: Keyword arguments of the wrapper (``max_norm``,
            ``communication_size``, ``master_dtype``, ...).

    Raises:
        ValueError: If ``fully_shard`` is asked without ``fsdp``, if checkpoints
            would fall between the micro-batches of an accumulated step, if
            ``resume`` finds no checkpoint, or if the checkpoint is past
            ``args.iters`` or was saved with another batch size or accumulation.
    """
    from mlx_lm.tuner import trainer

    args = args if args is not None else trainer.TrainingArgs()
    check_options(fsdp, fully_shard, reshard_after_forward)
    settings = {k: getattr(args, k) for k in checkpoints.ORDER_SETTINGS}
    every = args.steps_per_save
    if checkpoint_dir and every % args.grad_accumulation_steps:
        raise ValueError(
            f"steps_per_save={every} (--save-every) is not a multiple of "
            f"grad_accumulation_steps={args.grad_accumulation_steps}: checkpoints are "
            "taken after optimizer steps. Make it a multiple."
        )
    if resume and not checkpoint_dir:
        raise ValueError("resume=True needs checkpoint_dir, the directory to resume from.")
    k = args.grad_accumulation_steps
    if accumulation not in ("local", "sharded"):
        raise ValueError(f"accumulation={accumulation!r} must be 'local' or 'sharded'.")
    sharded_accumulation = accumulation == "sharded" and k > 1
    if sharded_accumulation:
        options = dict(options, grad_accumulation_steps=k, accumulation="sharded")
    wrapped = _wrap(optimizer, fsdp, options)
    rank = mx.distributed.init().rank()
    plain_model = model
    if fully_shard:
        # mlx-lm's grad_checkpoint would leave gathered parameters in the blocks
        # when it recomputes them; reshard_after_forward is the same recomputation.
        model = shard_model(model, communication_size=options.get("communication_size"),
                            reshard_after_forward=reshard_after_forward or args.grad_checkpoint)
        args = dataclasses.replace(args, grad_checkpoint=False)
    if sharded_modules(model):  # sharded here, or by the caller
        check_options(fsdp, True, reshard_after_forward)

    start, position = 0, None
    if resume:
        path = checkpoints.latest(checkpoint_dir)
        if path is None:
            raise ValueError(
                f"resume: no checkpoint in checkpoint_dir={checkpoint_dir!r}; train "
                "without resume to start, or point it at the run's checkpoint directory."
            )
        meta = checkpoints.load(path, model, wrapped, settings)
        start, position = meta["iteration"], meta["data"]
        if start > args.iters:
            raise ValueError(
                f"The checkpoint {path} is at iteration {start}, past iters={args.iters}; "
                "give the iteration the run should end at."
            )
        if rank == 0:
            print(f"Resumed from {path} (iteration {start} of {args.iters})", flush=True)

    def save(iteration: int, final: bool = False):
        # At the end also off --save-every's iterations: the trainer's own final
        # file would hold this rank's shards of a fully sharded model.
        if iteration % every == 0 or final:
            save_adapters(args.adapter_file, model, iteration if iteration % every == 0 else None)
        if checkpoint_dir and (iteration % every == 0 or iteration % k == 0):
            path = checkpoints.save(checkpoint_dir, model, wrapped, batches.position(), settings)
            if rank == 0:
                print(f"Saved checkpoint {path}", flush=True)

    def after_step(iteration: int):
        if iteration % every == 0:
            save(iteration)

    batches = ResumableBatches(
        iterate_batches or trainer.iterate_batches, steps_per_eval=args.steps_per_eval,
        iters=args.iters, start=start, position=position, on_step=after_step,
    )
    left = args.iters - start
    # Saving is done here (run-wide numbering, checkpoints), never by the trainer;
    # sharded accumulation by the optimizer, never by the trainer.
    run_args = dataclasses.replace(
        args, iters=left, steps_per_save=left + 1,
        grad_accumulation_steps=1 if sharded_accumulation else k)
    with sharded_training(wrapped):
        trainer.train(
            model=model, optimizer=wrapped, train_dataset=train_dataset,
            val_dataset=val_dataset, args=run_args, loss=loss or trainer.default_loss,
            iterate_batches=batches,
            training_callback=_Reports(training_callback, start, log_file, rank),
        )
    if args.iters > start:
        save(args.iters, final=True)
    if not unshard:
        return model
    unshard_model(model, plain_model)
    return plain_model
