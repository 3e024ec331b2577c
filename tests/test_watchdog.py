"""One process: the watchdog's default and settings, how it judges a wait, and the last raw errors.

The watchdog ends hangs on real ranks in ``test_faults.py``; here its
decisions are checked against a main thread that sleeps (blocked, as in a
stuck collective), computes in one long evaluation, or loops over short
ones, with an exit function that records instead of exiting.
"""

import threading
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

import mlx_fsdp
from mlx_fsdp import watchdog
from workers.common import batch, loss_fn, make_model

WRAPPERS = [mlx_fsdp.fsdp_step, mlx_fsdp.ddp_step]

# --- the timeout: on by default, MLX_FSDP_TIMEOUT for a job, timeout= wins, 0 is off


@pytest.mark.parametrize("env, timeout, expected", [
    (None, None, watchdog.DEFAULT_TIMEOUT),
    ("45", None, 45.0),
    ("0", None, None),
    ("45", 7, 7.0),
    ("45", 0, None),
    (None, 0.5, 0.5),
])
def test_the_timeout_is_on_by_default_set_by_the_environment_and_by_the_argument(
        monkeypatch, env, timeout, expected):
    if env is None:
        monkeypatch.delenv(watchdog.ENV, raising=False)
    else:
        monkeypatch.setenv(watchdog.ENV, env)
    assert watchdog.DEFAULT_TIMEOUT == 600
    for wrap in WRAPPERS:
        opt = wrap(optim.SGD(learning_rate=0.1), timeout=timeout)
        assert opt.options.timeout == expected
        assert opt._dog is None  # one process waits for no one: exactly plain MLX


@pytest.mark.parametrize("env, timeout, match", [
    (None, -1, "timeout=-1 must be a number of seconds >= 0"),
    (None, float("inf"), "timeout=inf must be a number of seconds >= 0"),
    (None, "10", "timeout='10' must be a number of seconds >= 0"),
    (None, True, "timeout=True must be a number of seconds >= 0"),
    ("10m", None, "MLX_FSDP_TIMEOUT='10m' must be a number of seconds >= 0"),
    ("-5", None, "MLX_FSDP_TIMEOUT=-5.0 must be a number of seconds >= 0"),
])
def test_a_bad_timeout_is_refused_with_its_name(monkeypatch, env, timeout, match):
    if env is not None:
        monkeypatch.setenv(watchdog.ENV, env)
    for wrap in WRAPPERS:
        with pytest.raises(ValueError, match=match + r".*0 turns the watchdog off"):
            wrap(optim.SGD(learning_rate=0.1), timeout=timeout)


# --- how a wait is judged


class Recorder:
    """A watchdog whose exit records the time instead of ending the process."""

    def __init__(self, timeout):
        self.fired, self.event, self.start = [], threading.Event(), time.monotonic()
        self.dog = watchdog.Watchdog(timeout, exit=self._exit)

    def _exit(self, code):
        self.fired.append((time.monotonic() - self.start, code))
        self.event.set()

    def block(self, seconds):
        """Block the main thread in one call, as a stuck collective does, until it fires."""
        return self.event.wait(seconds)


def _compute(seconds):
    """Evaluate for about ``seconds`` in one call (a chain of matmuls)."""
    a = mx.random.normal((128, 128)) / 11
    x, start = a, time.monotonic()
    for _ in range(20):
        x = mx.tanh(x @ a)
    mx.eval(x)
    for _ in range(int(seconds * 20 / max(time.monotonic() - start, 1e-4))):
        x = mx.tanh(x @ a)
    mx.eval(x)


def test_an_exact_wait_fires_after_its_timeout_and_allowance():
    r = Recorder(0.3)
    r.dog.waiting("a save", allowance=0.5)
    assert r.block(5) and r.fired[0][1] == watchdog.EXIT_CODE
    assert r.fired[0][0] >= 0.8  # the timeout, the allowance, and the grace before exiting


def test_a_lazy_wait_fires_when_the_main_thread_is_blocked_without_work():
    r = Recorder(0.3)
    r.dog.waiting("the step", lazy=True)
    assert r.block(5)  # blocked in one call, MLX idle: what a stuck collective looks like


def test_a_lazy_wait_does_not_fire_while_computing_or_looping_over_short_evaluations():
    r = Recorder(0.3)
    r.dog.waiting("the step", lazy=True)
    _compute(1.0)  # one evaluation, three times the timeout
    start = time.monotonic()
    model = make_model(bf16=False)
    while time.monotonic() - start < 1.0:  # validation: many tiny evaluations at one line
        mx.eval(loss_fn(model, *batch(0, 0)))
    r.dog.done()
    assert r.fired == []


def test_a_forward_wait_ends_with_its_evaluation_and_never_replaces_a_wait():
    r = Recorder(0.3)
    r.dog.forward("a fully sharded forward pass")
    _compute(0.3)
    assert not r.block(1.0)  # after the evaluation: blocked in something else
    assert r.dog._wait is None
    r.dog.waiting("the step", lazy=True)
    r.dog.forward("a fully sharded forward pass")
    assert r.dog._wait.where == "the step"
    r.dog.done()
    r.dog.forward("a fully sharded forward pass")
    assert r.block(5)  # no evaluation ran its gathers: they are stuck


# --- learning rates: a ValueError naming the value and the fix, never a raw error


@pytest.mark.parametrize("wrap", WRAPPERS)
@pytest.mark.parametrize("bad", ["fast", float("nan"), float("inf"), None, [1e-3],
                                 mx.array([1e-3, 2e-3])])
def test_setting_a_learning_rate_that_is_not_a_finite_number(wrap, bad):
    opt = wrap(optim.AdamW(learning_rate=1e-3))
    with pytest.raises(ValueError, match=r"learning_rate=.* must be a finite number .*"
                                         r"opt\.learning_rate = 1e-4"):
        opt.learning_rate = bad
    assert opt.learning_rate.item() == pytest.approx(1e-3)
    opt.learning_rate = mx.array(2e-3)
    opt.learning_rate = 3e-3
    assert opt.learning_rate.item() == pytest.approx(3e-3)


def _snapshot(model, opt):
    return [(k, mx.array(v)) for k, v in tree_flatten([model.parameters(), opt.state])]


def _unchanged(model, opt, snap):
    now = _snapshot(model, opt)
    return [k for k, _ in now] == [k for k, _ in snap] and all(
        mx.array_equal(a, b, equal_nan=True).item() for (_, a), (_, b) in zip(now, snap))


@pytest.mark.parametrize("wrap", WRAPPERS)
@pytest.mark.parametrize("make, match", [
    (lambda: optim.SGD(learning_rate=lambda step: mx.array(1.0) / (step - 1)),
     r"SGD has learning_rate=-?inf at step 1 from its schedule; it must be a finite number\. "
     r"Check the schedule"),
    (lambda: optim.SGD(learning_rate=lambda step: mx.array(0.1) if step.item() < 1 else "fast"),
     r"SGD has learning_rate='fast' at step 1 from its schedule; it must be a finite number"),
], ids=["division by zero", "text"])
def test_a_schedule_that_returns_no_finite_number_fails_at_that_step(wrap, make, match):
    model, opt = make_model(bf16=False), wrap(make())
    _, g = nn.value_and_grad(model, loss_fn)(model, *batch(0, 0))
    opt.update(model, g)  # step 0: 1 / -1
    mx.eval(model.parameters(), opt.state)
    snap = _snapshot(model, opt)
    with pytest.raises(ValueError, match=match):
        opt.update(model, g)
    assert _unchanged(model, opt, snap)


@pytest.mark.parametrize("wrap", WRAPPERS)
def test_a_rate_set_on_the_wrapped_optimizer_is_checked_at_the_step(wrap):
    model, opt = make_model(bf16=False), wrap(optim.Adam(learning_rate=1e-3))
    opt.optimizer.learning_rate = float("nan")  # around the wrapper's setter
    _, g = nn.value_and_grad(model, loss_fn)(model, *batch(0, 0))
    with pytest.raises(ValueError, match=r"Adam has learning_rate=nan at step 0; it must be a "
                                         r"finite number\. .* opt\.learning_rate = 1e-4"):
        opt.update(model, g)


# --- a gradient tree that changes between steps


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 3), nn.Linear(3, 3)


def _grads(*names):
    return {n: {"weight": mx.full((3, 3), 0.5), "bias": mx.full((3,), 0.25)} for n in names}


@pytest.mark.parametrize("wrap", WRAPPERS)
def test_a_gradient_tree_that_changes_gets_the_error_of_the_sharded_step(wrap):
    model, opt = TwoLayers(), wrap(optim.Adam(learning_rate=1e-2))
    opt.update(model, _grads("l1"))
    mx.eval(model.parameters(), opt.state)
    snap = _snapshot(model, opt)
    with pytest.raises(ValueError, match=(
            r"^The gradient tree changed since the optimizer state was built: it was for 2 arrays "
            r"\(12 elements\), now there are 2 \(12\): 'l2\.weight' has no optimizer state .* The "
            r"optimizer state cannot follow; .* opt\.init\(model\.trainable_parameters\(\)\)")):
        opt.update(model, _grads("l2"))  # plain MLX: KeyError: 'l2', after counting the step
    assert _unchanged(model, opt, snap)


@pytest.mark.parametrize("wrap", WRAPPERS)
def test_a_subset_of_what_the_state_was_built_for_steps_as_plain_mlx(wrap):
    model, ref_model = TwoLayers(), TwoLayers()
    ref_model.update(model.parameters())
    opt, ref = wrap(optim.Adam(learning_rate=1e-2)), optim.Adam(learning_rate=1e-2)
    for names in (("l1", "l2"), ("l1",), ("l2",)):
        opt.update(model, _grads(*names))
        ref.update(ref_model, _grads(*names))
        mx.eval(model.parameters(), ref_model.parameters(), opt.state, ref.state)
    for (_, a), (_, b) in zip(tree_flatten(model.parameters()), tree_flatten(ref_model.parameters())):
        assert mx.array_equal(a, b)


def test_the_watchdog_thread_of_a_process_is_one_per_timeout():
    assert watchdog.get(None, 0) is None
    assert watchdog.get(3.5, 0) is watchdog.get(3.5, 0)
    assert threading.active_count() >= 2
