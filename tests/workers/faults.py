"""Ranks that disagree, skip a call or stop: one case per launch.

Usage: faults.py CASE [TIMEOUT]

Every rank prints one line, ``rank R: <exception type>: <message>`` or
``rank R: NO ERROR``, and ``rank R: unchanged=<bool>`` when the case checks
that the failed step left the model and the optimizer as they were. Cases
where a rank stops or leaves end through the watchdog (``TIMEOUT`` seconds).
"""

import os
import signal
import sys
import time

from common import batch, loss_fn, make_model

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

import mlx_fsdp

group = mx.distributed.init()
rank = group.rank()
case = sys.argv[1]
timeout = float(sys.argv[2]) if len(sys.argv) > 2 else None
other = rank == group.size() - 1  # the rank that does something different


def say(text):
    print(f"rank {rank}: {text}", flush=True)


def snapshot(model, opt):
    return [mx.array(v) for _, v in tree_flatten([model.parameters(), opt.state])]


def same(a, b):
    return len(a) == len(b) and all(
        x.shape == y.shape and mx.array_equal(x, y, equal_nan=True).item() for x, y in zip(a, b))


def optimizer():
    if case == "learning_rate":
        return optim.AdamW(learning_rate=2e-3 if other else 1e-3)
    if case == "schedule":
        return optim.AdamW(learning_rate=optim.cosine_decay(2e-3 if other else 1e-3, 10))
    if case == "optimizer_class":
        return optim.SGD(learning_rate=1e-3) if other else optim.AdamW(learning_rate=1e-3)
    if case == "hyperparameter":
        return optim.AdamW(learning_rate=1e-3, weight_decay=0.1 if other else 0.01)
    return optim.AdamW(learning_rate=1e-3)


def wrapper():
    kwargs = {"timeout": timeout}
    if case == "max_norm":
        kwargs["max_norm"] = None if other else 1.0
    if case == "accumulation_steps":
        kwargs["grad_accumulation_steps"] = 3 if other else 2
    make = mlx_fsdp.ddp_step if case.startswith("ddp") else mlx_fsdp.fsdp_step
    return make(optimizer(), **kwargs)


def step(model, opt, s):
    _, g = nn.value_and_grad(model, loss_fn)(model, *batch(s, rank))
    if case in ("tree_changes", "ddp_tree") and other and s >= (1 if case == "tree_changes" else 0):
        g = {k: v for k, v in g.items() if k != "scale"}  # one array fewer, on one rank
    opt.update(model, g)
    mx.eval(model.parameters(), opt.state)


model, opt = make_model(), wrapper()
try:
    if case == "resumed_differently":
        # As if the first rank had loaded a checkpoint of step 2 and the other started fresh.
        opt.init(model.trainable_parameters())
        if not other:
            opt.optimizer.state["step"] = mx.array(2, mx.uint64)
    if case == "stop":
        for s in range(3):
            step(model, opt, s)
            if s == 1 and other:
                os.kill(os.getpid(), signal.SIGSTOP)
        say("NO ERROR")
        sys.exit(0)
    for s in range(3):
        if case == "one_update_fewer" and other and s == 2:
            break  # this rank skips its last update and goes on to exit
        before = snapshot(model, opt)
        try:
            step(model, opt, s)
        except ValueError:
            say(f"unchanged={same(before, snapshot(model, opt))}")
            raise
    say("NO ERROR")
except (ValueError, RuntimeError) as e:
    say(f"{type(e).__name__}: {e}")
    sys.exit(1)
finally:
    time.sleep(0.2)  # let the output reach the launcher before a peer's exit stops it
