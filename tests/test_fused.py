"""The compiled optimizer update (mlx_fsdp.fused), which fsdp_step uses on a GPU.

It runs here on the CPU (MLX compiles CPU kernels with the system compiler):
the same updates as the plain optimizer, a fallback for an update that
cannot be traced, and a new trace when the state is replaced.
"""

import warnings

import mlx.core as mx
import mlx.optimizers as optim
import pytest

from mlx_fsdp.fused import FusedUpdates

MAKERS = {
    "adamw": lambda: optim.AdamW(learning_rate=1e-3, weight_decay=0.05),
    "sgd": lambda: optim.SGD(learning_rate=0.1, momentum=0.9, weight_decay=1e-3),
    "lion": lambda: optim.Lion(learning_rate=1e-3),
    "adam_scheduled": lambda: optim.Adam(learning_rate=optim.cosine_decay(1e-2, 10)),
    "muon": lambda: optim.Muon(learning_rate=1e-2),
}


def _tree(seed):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return {"w": mx.random.normal((12, 7), key=k1), "b": mx.random.normal((7,), key=k2)}


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_fused_updates_equal_the_plain_optimizer(name):
    plain, fused_opt, fused = MAKERS[name](), MAKERS[name](), FusedUpdates()
    p1 = p2 = _tree(0)
    for step in range(4):
        g = _tree(100 + step)
        p1 = plain.apply_gradients(g, p1)
        p2 = fused.apply(fused_opt, g, p2)
        mx.eval(p1, p2, plain.state, fused_opt.state)
        for k in p1:
            assert mx.allclose(p1[k], p2[k], rtol=1e-6, atol=1e-7), (name, step, k)
    assert fused_opt.step.item() == plain.step.item() == 4


class _HostReading(optim.SGD):
    """An optimizer whose update reads a value on the host: it cannot be traced."""

    def apply_single(self, gradient, parameter, state):
        scale = 0.5 if gradient.abs().max().item() > 1e9 else 1.0
        return super().apply_single(gradient * scale, parameter, state)


def test_an_update_that_cannot_be_traced_runs_eagerly():
    plain, odd, fused = optim.SGD(learning_rate=0.1), _HostReading(learning_rate=0.1), FusedUpdates()
    p1 = p2 = _tree(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            g = _tree(10 + step)
            p1 = plain.apply_gradients(g, p1)
            p2 = fused.apply(odd, g, p2)
            mx.eval(p1, p2)
    assert sum("could not be compiled" in str(w.message) for w in caught) == 1
    assert all(mx.allclose(p1[k], p2[k]) for k in p1)
    assert odd.step.item() == 3


def test_a_replaced_state_is_traced_anew():
    opt, fused = optim.Adam(learning_rate=1e-2), FusedUpdates()
    p = fused.apply(opt, _tree(1), _tree(0))
    mx.eval(p, opt.state)
    saved = {"step": opt.state["step"], "learning_rate": opt.state["learning_rate"],
             "w": dict(opt.state["w"]), "b": dict(opt.state["b"])}
    opt.state = saved  # a new dict, as a checkpoint load gives
    ref = optim.Adam(learning_rate=1e-2)
    ref.state = {k: (dict(v) if isinstance(v, dict) else v) for k, v in saved.items()}
    g = _tree(2)
    q, r = fused.apply(opt, g, p), ref.apply_gradients(g, p)
    mx.eval(q, r, opt.state)
    assert opt.step.item() == 2 and all(mx.allclose(q[k], r[k]) for k in q)
