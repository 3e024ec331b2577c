"""Shared by the lm_* workers: a LoRA model and mlx-lm's own trainer, run in this process;
command lines of several runs."""

import os
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset  # noqa: E402
from mlx_lm.tuner.trainer import TrainingArgs, TrainingCallback, train  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers  # noqa: E402

from common import max_diff, report  # noqa: E402,F401

ITERS = 8


def split_runs(argv) -> list:
    """``FLAGS [--- FLAGS ...]``: the flags of each run, in order."""
    runs, flags = [], []
    for a in list(argv) + ["---"]:
        if a == "---":
            runs.append(flags)
            flags = []
        else:
            flags.append(a)
    return runs


def lora_model(model_path: str):
    """The model at ``model_path`` with LoRA on both layers, as mlx_lm.lora builds it (seed 0)."""
    mx.random.seed(0)
    model, tokenizer = load(model_path)
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "dropout": 0.0, "scale": 10.0})
    return model, tokenizer


class _Losses(TrainingCallback):
    def __init__(self):
        self.losses = []

    def on_train_loss_report(self, info):
        self.losses.append(info["train_loss"])


def run_trainer(model, tokenizer, data: str, optimizer, grad_accumulation_steps: int = 1):
    """mlx-lm's ``train`` for :data:`ITERS` iterations in batches of 6; the losses and adapters."""
    np.random.seed(0)
    train_set, _, _ = load_local_dataset(
        Path(data), tokenizer, types.SimpleNamespace())
    losses = _Losses()
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArgs(batch_size=6, iters=ITERS, steps_per_report=1,
                            grad_accumulation_steps=grad_accumulation_steps,
                            adapter_file=os.path.join(tmp, "adapters.safetensors"))
        train(model, optimizer, CacheDataset(train_set), None, args=args,
              training_callback=losses)
    return losses.losses, dict(tree_flatten(model.trainable_parameters()))


def compare(group, reference, ours, **extra):
    """Report the largest loss and adapter differences (rank 0 prints the RESULT line)."""
    (ref_losses, ref_params), (losses, params) = reference, ours
    report(group, **extra, iterations=len(losses),
           max_loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)),
           max_param_diff=max_diff(params, ref_params))
