"""One process: the wrappers equal plain MLX exactly, and bad input gets clear errors."""

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

import mlx_fsdp
from mlx_fsdp.sharded_state import check_state
from mlx_fsdp.plan import build_plan
from workers.common import batch, loss_fn, make_model


#: The model's 706 elements times float32's unit roundoff: how far two orders
#: of summing their squares may differ, relatively.
NORM_RTOL = 706 * 2.0**-24


def _same(a, b):
    return all(mx.array_equal(x, y) for (_, x), (_, y) in zip(tree_flatten(a), tree_flatten(b)))


@pytest.mark.parametrize("wrap", [mlx_fsdp.fsdp_step, mlx_fsdp.ddp_step])
@pytest.mark.parametrize("max_norm", [None, 0.3])
def test_one_process_is_exactly_the_plain_optimizer(wrap, max_norm):
    model, ref_model = make_model(bf16=False), make_model(bf16=False)
    opt = wrap(optim.AdamW(learning_rate=1e-2), max_norm=max_norm)
    ref = optim.AdamW(learning_rate=1e-2)
    for step in range(3):
        _, g = nn.value_and_grad(model, loss_fn)(model, *batch(step, 0))
        opt.update(model, g)
        _, g = nn.value_and_grad(ref_model, loss_fn)(ref_model, *batch(step, 0))
        if max_norm is not None:
            g, norm = optim.clip_grad_norm(g, max_norm)
            assert mx.array_equal(opt.grad_norm, norm)
        ref.update(ref_model, g)
        mx.eval(model.parameters(), ref_model.parameters(), opt.state, ref.state)
        assert _same(model.parameters(), ref_model.parameters())
    assert _same(opt.state["optimizer"], ref.state)
    assert opt.step.item() == 3


def test_multioptimizer_on_one_process():
    model, ref_model = make_model(bf16=False), make_model(bf16=False)

    def multi():
        return optim.MultiOptimizer(
            [optim.SGD(learning_rate=0.1), optim.Adam(learning_rate=1e-2)],
            [lambda path, g: g.ndim == 1],
        )

    opt, ref = mlx_fsdp.fsdp_step(multi()), multi()
    for step in range(2):
        _, g = nn.value_and_grad(model, loss_fn)(model, *batch(step, 0))
        opt.update(model, g)
        _, g = nn.value_and_grad(ref_model, loss_fn)(ref_model, *batch(step, 0))
        ref.update(ref_model, g)
    mx.eval(model.parameters(), ref_model.parameters())
    assert _same(model.parameters(), ref_model.parameters())


def test_compile_with_state_inputs_and_outputs():
    model, ref_model = make_model(), make_model()
    opt = mlx_fsdp.fsdp_step(optim.Adam(learning_rate=1e-2), max_norm=0.5)
    ref = mlx_fsdp.fsdp_step(optim.Adam(learning_rate=1e-2), max_norm=0.5)
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y):
        loss, g = nn.value_and_grad(model, loss_fn)(model, x, y)
        opt.update(model, g)
        return loss

    for i in range(3):
        step(*batch(i, 0))
        _, g = nn.value_and_grad(ref_model, loss_fn)(ref_model, *batch(i, 0))
        ref.update(ref_model, g)
        mx.eval(state, ref_model.parameters(), ref.state)
        # A compiled graph may fuse the sum of squares and add in another order:
        # float32 sums of n terms agree to about n * 2**-24 relative.
        assert mx.allclose(opt.grad_norm, ref.grad_norm, rtol=NORM_RTOL, atol=0)
    # On an H200 (mlx-cuda 0.32.4, TF32 off) compiled and eager parameters
    # differed by up to 1.6e-4 after three Adam steps of 1e-2: fused GPU kernels
    # round otherwise, and Adam's m / sqrt(v) magnifies that where a gradient is
    # near zero. Still a tenth of one step, far below what a wrong update moves.
    # On an H100 a bfloat16 weight of 0.1-0.25 then came out one ulp apart
    # (2**-10 there): on a GPU a bfloat16 array may differ by one rounding.
    gpu = mx.default_device() != mx.cpu
    atol = 1e-3 if gpu else 1e-6
    for (_, a), (_, b) in zip(tree_flatten(model.parameters()), tree_flatten(ref_model.parameters())):
        rtol = 2.0**-7 if gpu and a.dtype == mx.bfloat16 else 1e-5  # 1e-5: allclose's own
        assert mx.allclose(a, b, atol=atol, rtol=rtol)


def test_learning_rate_is_forwarded_and_settable():
    opt = mlx_fsdp.fsdp_step(optim.SGD(learning_rate=0.1))
    assert opt.learning_rate.item() == pytest.approx(0.1)
    opt.learning_rate = 0.05
    assert opt.optimizer.learning_rate.item() == pytest.approx(0.05)


def test_schedule_steps_like_the_plain_optimizer():
    sched = optim.linear_schedule(1.0, 0.0, 10)
    opt = mlx_fsdp.fsdp_step(optim.SGD(learning_rate=sched))
    params = {"w": mx.ones((3,))}
    for _ in range(4):
        params = opt.apply_gradients({"w": mx.ones((3,))}, params)
    mx.eval(params)
    # Steps 0..3 used learning rates 1.0, 0.9, 0.8, 0.7.
    assert params["w"].tolist() == pytest.approx([1 - 3.4] * 3)
    assert opt.step.item() == 4


def test_non_finite_gradients_show_in_grad_norm():
    opt = mlx_fsdp.fsdp_step(optim.SGD(learning_rate=0.1), max_norm=1.0)
    out = opt.apply_gradients({"w": mx.array([1.0, float("nan")])}, {"w": mx.ones((2,))})
    mx.eval(out)
    assert mx.isnan(opt.grad_norm).item()
    opt.apply_gradients({"w": mx.array([1.0, float("inf")])}, {"w": mx.ones((2,))})
    assert mx.isinf(opt.grad_norm).item()


def test_grad_norm_is_none_without_clipping():
    opt = mlx_fsdp.fsdp_step(optim.SGD(learning_rate=0.1))
    opt.apply_gradients({"w": mx.ones((2,))}, {"w": mx.ones((2,))})
    assert opt.grad_norm is None


def test_dropin_on_one_process_returns_like_mlx_031():
    opt, ref = optim.SGD(learning_rate=0.1), optim.SGD(learning_rate=0.1)
    params, grads = {"w": mx.ones((2, 3))}, {"w": mx.full((2, 3), 2.0)}
    out = mlx_fsdp.fsdp_apply_gradients(grads, params, opt)
    assert mx.array_equal(out["w"], ref.apply_gradients(grads, params)["w"])
    out, norm = mlx_fsdp.fsdp_apply_gradients(grads, params, opt, max_norm=1.0)
    assert norm.item() == pytest.approx(24**0.5)


# Bad input -----------------------------------------------------------------


def test_not_an_optimizer():
    with pytest.raises(ValueError, match="not an mlx.optimizers.Optimizer"):
        mlx_fsdp.fsdp_step(lambda g: g)


@pytest.mark.parametrize("bad", [-1.0, 0, 0.0, "1", True, float("nan"), float("inf")])
def test_bad_max_norm(bad):
    for wrap in (mlx_fsdp.fsdp_step, mlx_fsdp.ddp_step):
        with pytest.raises(ValueError, match="max_norm=.* must be a finite number > 0"):
            wrap(optim.SGD(learning_rate=0.1), max_norm=bad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_learning_rate_is_refused(bad):
    with pytest.raises(ValueError, match="AdamW has learning_rate=(nan|inf); it must be a finite"):
        mlx_fsdp.fsdp_step(optim.AdamW(learning_rate=bad))
    multi = optim.MultiOptimizer([optim.SGD(learning_rate=0.1), optim.Adam(learning_rate=bad)],
                                 [lambda path, g: g.ndim == 1])
    with pytest.raises(ValueError, match="Adam has learning_rate"):
        mlx_fsdp.ddp_step(multi)


@pytest.mark.parametrize("name", ["group", "dp_group"])
def test_a_group_must_be_a_group(name):
    with pytest.raises(ValueError, match=f"{name}='x' is not an mx.distributed.Group"):
        mlx_fsdp.fsdp_step(optim.SGD(learning_rate=0.1), **{name: "x"})


@pytest.mark.parametrize("kwargs, match", [
    ({"communication_stream": "s"}, "communication_stream='s' must be an mx.Stream"),
    ({"master_dtype": mx.int32}, "master_dtype=mlx.core.int32 must be a floating mlx dtype"),
    ({"reduce_dtype": "float32"}, "reduce_dtype='float32' must be a floating mlx dtype"),
    ({"grad_accumulation_steps": 0}, "grad_accumulation_steps=0 must be an int >= 1"),
    ({"accumulation": "global"}, "accumulation='global' is not supported here"),
    ({"timeout": -1}, "timeout=-1 must be a number of seconds >= 0"),
    ({"placement": "rows"}, "placement='rows' is not a placement"),
])
def test_bad_arguments_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mlx_fsdp.fsdp_step(optim.SGD(learning_rate=0.1), **kwargs)


def test_ddp_refuses_what_only_fsdp_has_and_unknown_options():
    with pytest.raises(ValueError, match=r"ddp_step got \['accumulation'\], which only fsdp_step has"):
        mlx_fsdp.ddp_step(optim.SGD(learning_rate=0.1), accumulation="sharded")
    with pytest.raises(ValueError, match=r"the unknown option\(s\) \['max_nrom'\]; its options are"):
        mlx_fsdp.ddp_step(optim.SGD(learning_rate=0.1), max_nrom=1.0)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_norm": -1.0}, "max_norm=-1.0 must be a finite number > 0"),
    ({"communication_size": "32MiB"}, "communication_size='32MiB' must be an int"),
    ({"fsdp_group": "x"}, "group='x' is not an mx.distributed.Group"),
    ({"placement": "rows"}, "placement='rows' is not a placement"),
])
def test_the_dropin_validates_its_arguments(kwargs, match):
    model = make_model(bf16=False)
    _, g = nn.value_and_grad(model, loss_fn)(model, *batch(0, 0))
    with pytest.raises(ValueError, match=match):
        mlx_fsdp.fsdp_apply_gradients(g, model.parameters(), optim.SGD(learning_rate=0.1), **kwargs)


def test_bad_communication_size():
    for wrap in (mlx_fsdp.fsdp_step, mlx_fsdp.ddp_step):
        with pytest.raises(ValueError, match="communication_size=1.5 must be an int"):
            wrap(optim.SGD(learning_rate=0.1), communication_size=1.5)


def test_gradient_without_a_parameter():
    opt = mlx_fsdp.fsdp_step(optim.SGD(learning_rate=0.1))
    with pytest.raises(ValueError, match="'v' has no parameter at that path"):
        opt.apply_gradients({"v": mx.ones((2,))}, {"w": mx.ones((2,))})


def test_gradient_with_the_wrong_shape():
    opt = mlx_fsdp.fsdp_step(optim.SGD(learning_rate=0.1))
    with pytest.raises(ValueError, match=r"'w' has shape \(3,\) but the parameter has shape \(2,\)"):
        opt.apply_gradients({"w": mx.ones((3,))}, {"w": mx.ones((2,))})


def test_state_setter_needs_the_wrappers_layout():
    opt = mlx_fsdp.fsdp_step(optim.SGD(learning_rate=0.1))
    with pytest.raises(ValueError, match="'optimizer' entry"):
        opt.state = {"step": mx.array(0)}


def test_state_made_for_another_plan_is_refused():
    plan = build_plan((("w", (7, 15), "float32", "float32", 0, "flat"),), 2, 0)
    opt = optim.Adam(learning_rate=1e-3)
    opt.init({"w": mx.zeros((53,))})
    check_state(plan, opt, 0)  # 105 elements over 2 ranks: 53 on rank 0
    bad = optim.Adam(learning_rate=1e-3)
    bad.init({"w": mx.zeros((35,))})  # made for N=3
    with pytest.raises(ValueError, match="does not fit this step's plan"):
        check_state(plan, bad, 0)


def test_hybrid_shard_size_must_divide():
    with pytest.raises(ValueError, match="shard_size=3 must be a positive integer that divides"):
        mlx_fsdp.hybrid_groups(3)
