"""The only places where mlx_fsdp reaches into mlx-lm's internals.

mlx-lm's trainer averages the gradients itself (``average_gradients`` inside
its compiled step); ``mlx_lm.lora`` builds its optimizer inside
``train_model`` with no way to pass another, loads the model whole and
tests the model it built; ``mlx_lm.utils.save`` writes the weights itself. These are module globals that the
functions below swap for the duration of a ``with`` block, after checking that
they are still what this code was written against (mlx-lm 0.32.2); if mlx-lm
changed, they raise a ``RuntimeError`` naming the installed version instead of
training silently wrong.
"""

from contextlib import contextmanager
from functools import partial
from typing import Callable

import mlx.nn as nn

#: The mlx-lm version these hooks were written and tested against.
TESTED_MLX_LM = "0.32.2"


def mlx_lm_version() -> str:
    """The installed mlx-lm's version string."""
    import mlx_lm

    return getattr(mlx_lm, "__version__", "unknown")


def _changed(what: str) -> RuntimeError:
    return RuntimeError(
        f"mlx-lm {mlx_lm_version()} changed {what}; mlx_fsdp.lm was written against "
        f"mlx-lm {TESTED_MLX_LM}. Install that version (pip install 'mlx-lm=="
        f"{TESTED_MLX_LM}') or update mlx_fsdp."
    )


def _keep_gradients(gradients, *args, **kwargs):
    """Stands in for ``average_gradients``: the optimizer wrapper communicates."""
    return gradients


@contextmanager
def trainer_all_reduce_removed():
    """Turn off the all-reduce of ``mlx_lm.tuner.trainer.train`` inside the block.

    ``train`` calls ``mlx.nn.average_gradients`` in its compiled step before
    ``optimizer.update``. With an :func:`~mlx_fsdp.fsdp_step` or
    :func:`~mlx_fsdp.ddp_step` optimizer, which reduce the gradients
    themselves, that is a second full all-reduce per step; inside this block it
    returns the local gradients unchanged. The trainer's step is traced on its
    first call, so ``train`` must be called (not only defined) inside the
    block. A plain optimizer trained inside it gets no averaging at all: use
    it only with a wrapper. The previous function is restored on exit, also
    after an exception.

    Raises:
        RuntimeError: If the installed mlx-lm's trainer no longer calls
            ``mlx.nn.average_gradients`` through a module global.
    """
    from mlx_lm.tuner import trainer

    current = getattr(trainer, "average_gradients", None)
    if current is not nn.average_gradients and current is not _keep_gradients:
        raise _changed(
            "mlx_lm.tuner.trainer.average_gradients (expected mlx.nn.average_gradients, "
            f"found {current!r})"
        )
    trainer.average_gradients = _keep_gradients
    try:
        yield
    finally:
        trainer.average_gradients = current


@contextmanager
def lora_train_replaced(train: Callable):
    """Make ``mlx_lm.lora`` call ``train`` instead of mlx-lm's trainer inside the block.

    ``mlx_lm.lora.train_model`` loads nothing itself but builds the optimizer
    and calls ``train(model=..., args=..., optimizer=..., train_dataset=...,
    val_dataset=..., training_callback=...)``, the trainer it imported. The
    replacement receives those arguments and can wrap the optimizer before it
    calls :func:`mlx_lm.tuner.trainer.train`.

    Args:
        train (Callable): Takes the keyword arguments above.

    Raises:
        RuntimeError: If the installed ``mlx_lm.lora`` no longer calls the
            trainer's ``train`` through a module global.
    """
    import mlx_lm.lora as lora
    from mlx_lm.tuner import trainer

    current = getattr(lora, "train", None)
    if current is not trainer.train:
        raise _changed(f"mlx_lm.lora.train (expected mlx_lm.tuner.trainer.train, found {current!r})")
    lora.train = train
    try:
        yield
    finally:
        lora.train = current


@contextmanager
def weights_written_apart():
    """Make ``mlx_lm.utils.save`` write everything but the weights inside the block.

    ``save`` writes the weights with ``save_model`` (a module global), then the
    config, the tokenizer and the model card. A fully sharded model's weights
    are written apart, a module at a time
    (:func:`mlx_fsdp.lm.sharding.save_whole_weights`), and mlx-lm writes the rest.

    Raises:
        RuntimeError: If the installed ``mlx_lm.utils`` has no ``save_model``.
    """
    import mlx_lm.utils as utils

    current = getattr(utils, "save_model", None)
    if not callable(current):
        raise _changed("mlx_lm.utils.save_model (expected the function mlx_lm.utils.save calls)")
    utils.save_model = lambda *args, **kwargs: None
    try:
        yield
    finally:
        utils.save_model = current


@contextmanager
def lora_loads_lazily():
    """Make ``mlx_lm.lora`` load the model lazily inside the block.

    ``mlx_lm.lora.run`` loads the model with ``mlx_lm.utils.load``, which
    evaluates every weight: every rank would hold the whole model before
    sharding it. Loaded lazily, a weight is read from its file when first
    evaluated, and :func:`mlx_fsdp.fully_shard` evaluates a rank's shards one
    wrapped module at a time, so no rank ever holds the whole model.

    Raises:
        RuntimeError: If the installed ``mlx_lm.lora`` no longer loads through
            ``mlx_lm.utils.load`` as a module global.
    """
    import mlx_lm.lora as lora
    from mlx_lm import utils

    current = getattr(lora, "load", None)
    if current is not utils.load:
        raise _changed(f"mlx_lm.lora.load (expected mlx_lm.utils.load, found {current!r})")
    lora.load = partial(current, lazy=True)
    try:
        yield
    finally:
        lora.load = current


@contextmanager
def lora_tests_model(trained: dict):
    """Make ``mlx_lm.lora``'s ``--test`` evaluate ``trained["model"]`` inside the block.

    ``mlx_lm.lora.run`` evaluates the model it built (``evaluate_model``, a
    module global) once training is done. A fully sharded run leaves that
    model's blocks wrapped; the model to evaluate is then the sharded one it
    trained, which gathers a block at a time, so that no rank holds the
    whole model for the test either. Without ``"model"`` in ``trained``,
    mlx-lm's own is evaluated.

    Raises:
        RuntimeError: If the installed ``mlx_lm.lora`` has no ``evaluate_model``.
    """
    import mlx_lm.lora as lora

    current = getattr(lora, "evaluate_model", None)
    if not callable(current):
        raise _changed("mlx_lm.lora.evaluate_model (expected the function run calls)")

    def evaluate_model(args, model, test_set):
        return current(args, trained.get("model", model), test_set)

    lora.evaluate_model = evaluate_model
    try:
        yield
    finally:
        lora.evaluate_model = current
