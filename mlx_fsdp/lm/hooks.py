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
def _swapped(module, name: str, expected: Callable, what: str, replacement: Callable):
    """``module.name`` set to ``replacement(current)`` inside the block, then restored
    (also after an exception); a ``RuntimeError`` naming the installed mlx-lm
    unless ``expected(current)``, where ``what`` says what was expected."""
    current = getattr(module, name, None)
    if not expected(current):
        raise _changed(f"{module.__name__}.{name} (expected {what}, found {current!r})")
    setattr(module, name, replacement(current))
    try:
        yield
    finally:
        setattr(module, name, current)


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

    with _swapped(trainer, "average_gradients",
                  lambda f: f is nn.average_gradients or f is _keep_gradients,
                  "mlx.nn.average_gradients", lambda _: _keep_gradients):
        yield


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

    with _swapped(lora, "train", lambda f: f is trainer.train, "mlx_lm.tuner.trainer.train",
                  lambda _: train):
        yield


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

    with _swapped(utils, "save_model", callable, "the function mlx_lm.utils.save calls",
                  lambda _: lambda *args, **kwargs: None):
        yield


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

    with _swapped(lora, "load", lambda f: f is utils.load, "mlx_lm.utils.load",
                  lambda load: partial(load, lazy=True)):
        yield


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

    def tests_trained(evaluate_model):
        return lambda args, model, test_set: evaluate_model(
            args, trained.get("model", model), test_set)

    with _swapped(lora, "evaluate_model", callable, "the function run calls", tests_trained):
        yield
