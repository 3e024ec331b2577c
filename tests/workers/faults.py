"""Ranks that disagree, skip a call or stop: one case per launch.

Usage: faults.py CASE [TIMEOUT]

Every rank prints one line, ``rank R: <exception type>: <message>`` or
``rank R: NO ERROR``, and ``rank R: unchanged=<bool>`` when the case checks
that the failed step left the model and the optimizer as they were. Cases
where a rank stops or leaves end through the watchdog: ``timeout=TIMEOUT``
when given, else its default (``MLX_FSDP_TIMEOUT``).
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
    # The line and its newline in one write: unbuffered (PYTHONUNBUFFERED),
    # print writes them apart, and under mpirun another rank's line could
    # land between them (a CI run once read two ranks' errors as one line).
    print(f"rank {rank}: {text}\n", end="", flush=True)


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


def long_evaluation(seconds):
    """An array whose evaluation computes for about ``seconds``: a chain of matmuls,
    as long on every rank (the ranks' mean speed)."""
    a = mx.random.normal((192, 192)) / 14
    start, x = time.monotonic(), a
    for _ in range(30):
        x = mx.tanh(x @ a)
    mx.eval(x)
    per_op = mx.distributed.all_sum(mx.array((time.monotonic() - start) / 30)).item()
    for _ in range(int(seconds * group.size() / per_op)):
        x = mx.tanh(x @ a)
    return x


def legitimate_waits():
    """Waits longer than the timeout that are not hangs: none may end the job.

    On a fully sharded model (its gathers and reduce-scatters run in the
    step's evaluation): a first step whose evaluation computes for 1.5 times
    the timeout (its collectives wait for that computation), an evaluation
    loop as long before the next call into the library, a save and a load.
    """
    limit = float(os.environ["MLX_FSDP_TIMEOUT"])
    sharded = mlx_fsdp.fully_shard(make_model(bf16=False))
    long = mx.stop_gradient(long_evaluation(1.5 * limit).sum())
    loss, g = nn.value_and_grad(sharded, lambda m, x, y: loss_fn(m, x, y) * (1 + 0 * long))(
        sharded, *batch(0, rank))
    opt.update(sharded, g)
    mx.eval(sharded.parameters(), opt.state)
    start = time.monotonic()
    while True:  # validation: many small evaluations, as many on every rank (they gather)
        late = mx.array(float(time.monotonic() - start > 1.5 * limit))
        if mx.distributed.all_sum(late).item() > 0:
            break
        mx.eval(loss_fn(sharded, *batch(100, rank)))
    # Beside the results file of the launch (tests/launch.py): a directory every rank sees.
    path = os.path.join(os.path.dirname(os.environ["MLX_FSDP_TEST_RESULTS"]), "ck")
    mlx_fsdp.save_checkpoint(path, sharded, opt)
    mlx_fsdp.load_checkpoint(path, sharded, opt)


def user_collective():
    """The last rank skips its update of step 1; then every rank sums its loss itself."""
    for s in range(2):
        loss, g = nn.value_and_grad(model, loss_fn)(model, *batch(s, rank))
        if not (other and s == 1):
            opt.update(model, g)
        # The cross-rank check cannot see this collective: only the watchdog can end it.
        mx.eval(mx.distributed.all_sum(loss), model.parameters(), opt.state)


def fully_sharded_stop():
    """The last rank stops before the first forward pass of a fully sharded model."""
    sharded = mlx_fsdp.fully_shard(make_model(bf16=False))
    if other:
        os.kill(os.getpid(), signal.SIGSTOP)
    loss, g = nn.value_and_grad(sharded, loss_fn)(sharded, *batch(0, rank))
    mx.eval(loss, g)  # its gathers wait for the stopped rank, before any update


def raises():
    """The last rank fails with an error of its own, which nothing catches, before step 1."""
    step(model, opt, 0)
    if other:
        1 / 0
    step(model, opt, 1)


CASES = {"legitimate": legitimate_waits, "user_collective": user_collective,
         "fully_sharded_stop": fully_sharded_stop, "raises": raises}

model, opt = make_model(), wrapper()
try:
    if case in CASES:
        CASES[case]()
        say("NO ERROR")
        sys.exit(0)
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
