"""fp32 master weights and gradient accumulation (issue 4, parts 1 and 2)."""

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest

import mlx_fsdp
from launch import run_ranks

F32_TOL = 1e-5


@pytest.mark.parametrize("n", [2, 3, 4])
def test_fp32_masters_match_ddp_masters_within_one_bf16_ulp(n):
    results = run_ranks(n, "precision.py", [4])
    assert [r["reduce_dtype"] for r in results] == ["None", "mlx.core.float32"]
    for r in results:
        assert r["ulps_vs_ddp"] <= 1.0, r
        if n == 2 and r["reduce_dtype"] == "None":
            assert r["ulps_vs_ref"] <= 1.0, r
        assert r["param_dtypes"] == ["mlx.core.bfloat16"], "the model must stay bfloat16"
        assert r["master_dtypes"] == r["state_dtypes"] == ["mlx.core.float32"], r
        assert r["masters_are_what_this_rank_holds"], r
        # Every rank about 1/N of DDP's masters, and together exactly DDP's.
        assert r["masters_total_over_ddp"] == 1.0, r
        assert abs(r["master_fraction"] - 1 / n) <= 0.1, r


@pytest.mark.parametrize("n", [2, 3, 4])
def test_accumulation_equals_one_step_on_the_concatenated_batch(n):
    (r,) = run_ranks(n, "accumulate.py", [3, 2])
    for name in ("fsdp_local", "fsdp_sharded", "fsdp_sharded_owner", "ddp_local"):
        assert r["max_diff"][name] <= F32_TOL, r
        assert r["moved_early"][name] == 0, f"{name} changed the model before the last micro-batch"
        assert r["opt_steps"][name] == r["ref_steps"] == 2, r


def _model():
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def _loss(model, x, y):
    return nn.losses.cross_entropy(model(x).astype(mx.float32), y, reduction="mean")


def test_one_process_masters_are_the_plain_optimizer_on_an_fp32_copy():
    model, ref_model = _model(), _model()
    opt = mlx_fsdp.fsdp_step(optim.Adam(learning_rate=1e-3), master_dtype=mx.float32)
    ref, master = optim.Adam(learning_rate=1e-3), None
    for step in range(3):
        x = mx.random.normal((8, 6), key=mx.random.key(step)).astype(mx.bfloat16)
        y = mx.arange(8) % 3
        _, g = nn.value_and_grad(model, _loss)(model, x, y)
        opt.update(model, g)
        _, g = nn.value_and_grad(ref_model, _loss)(ref_model, x, y)
        if master is None:
            master = {k: v for k, v in nn.utils.tree_map(
                lambda p: p.astype(mx.float32), ref_model.trainable_parameters()).items()}
        master = ref.apply_gradients(nn.utils.tree_map(lambda a: a.astype(mx.float32), g), master)
        ref_model.update(nn.utils.tree_map(lambda p: p.astype(mx.bfloat16), master))
        mx.eval(model.parameters(), opt.state, ref_model.parameters(), master)
    for (k, a), (_, b) in zip(nn.utils.tree_flatten(model.parameters()),
                              nn.utils.tree_flatten(ref_model.parameters())):
        assert a.dtype == mx.bfloat16 and mx.array_equal(a, b), k
    assert all(v.dtype == mx.float32 for v in opt.state["master"].values())
    assert opt.step.item() == 3


def test_init_builds_masters_and_fp32_state():
    model = _model()
    opt = mlx_fsdp.ddp_step(optim.Adam(learning_rate=1e-3), master_dtype=mx.float32)
    opt.init(model.trainable_parameters())
    assert set(opt.state["master"]) == {k for k, _ in nn.utils.tree_flatten(model.trainable_parameters())}
    m = opt.state["optimizer"]["layers"][0]["weight"]["m"]
    assert m.dtype == mx.float32


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(grad_accumulation_steps=0), "grad_accumulation_steps=0"),
        (dict(grad_accumulation_steps=2.0), "grad_accumulation_steps=2.0"),
        (dict(accumulation="global"), "accumulation='global'"),
        (dict(master_dtype=mx.int32), "master_dtype=mlx.core.int32"),
        (dict(reduce_dtype="float32"), "reduce_dtype='float32'"),
    ],
)
def test_bad_options_name_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        mlx_fsdp.fsdp_step(optim.SGD(learning_rate=0.1), **kwargs)


def test_ddp_has_no_sharded_accumulation():
    with pytest.raises(ValueError, match="only fsdp_step has"):
        mlx_fsdp.ddp_step(optim.SGD(learning_rate=0.1), accumulation="sharded")


def _adam():
    return optim.Adam(learning_rate=1e-2)


def _muon_and_adamw():
    # A MultiOptimizer's state is a list of its parts' states: keeping them on
    # the micro-batches that do not finish the step must reach into the list.
    return optim.MultiOptimizer([optim.Muon(learning_rate=2e-2), optim.AdamW(learning_rate=1e-2)],
                                [lambda path, g: g.ndim == 2])


@pytest.mark.parametrize("inner", [_adam, _muon_and_adamw])
@pytest.mark.parametrize("wrap", ["fsdp_local", "fsdp_sharded", "ddp"])
def test_accumulation_inside_mx_compile_equals_eager(wrap, inner):
    # The micro-step counter and the sums are arrays in opt.state, so a compiled
    # step carries them; every call runs the whole step and keeps the old
    # parameters and state on the micro-batches that do not finish it.
    make = {"fsdp_local": lambda: mlx_fsdp.fsdp_step(inner(), grad_accumulation_steps=3),
            "fsdp_sharded": lambda: mlx_fsdp.fsdp_step(inner(), grad_accumulation_steps=3,
                                                       accumulation="sharded"),
            "ddp": lambda: mlx_fsdp.ddp_step(inner(), grad_accumulation_steps=3)}[wrap]
    model, eager_model = _model(), _model()
    model.set_dtype(mx.float32), eager_model.set_dtype(mx.float32)
    opt, eager = make(), make()
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y):
        _, g = nn.value_and_grad(model, _loss)(model, x, y)
        opt.update(model, g)

    x = mx.random.normal((12, 6), key=mx.random.key(5))
    y = mx.arange(12) % 3
    for i in range(7):  # two whole steps and one micro-batch
        part = slice(2 * (i % 6), 2 * (i % 6) + 2)
        step(x[part], y[part])
        _, g = nn.value_and_grad(eager_model, _loss)(eager_model, x[part], y[part])
        eager.update(eager_model, g)
        mx.eval(model.parameters(), opt.state, eager_model.parameters(), eager.state)
        for (k, a), (_, b) in zip(nn.utils.tree_flatten(model.parameters()),
                                  nn.utils.tree_flatten(eager_model.parameters())):
            assert mx.abs(a - b).max().item() <= 1e-6, (i, k)
    assert opt.step.item() == eager.step.item() == 2
    assert opt.micro_step == eager.micro_step == 1


def test_master_shards_reshard_through_a_checkpoint(tmp_path):
    first, second = str(tmp_path / "n2"), str(tmp_path / "n3")
    (r,) = run_ranks(2, "ckpt_master.py", ["save", first])
    assert r["masters_held"] == 2  # on every rank, a master for everything it holds
    (r,) = run_ranks(3, "ckpt_master.py", ["resave", first, second])
    assert r["masters_held"] == 3
    mlx_fsdp.consolidate_checkpoint(first, str(tmp_path / "a.safetensors"))
    mlx_fsdp.consolidate_checkpoint(second, str(tmp_path / "b.safetensors"))
    a, b = mx.load(str(tmp_path / "a.safetensors")), mx.load(str(tmp_path / "b.safetensors"))
    masters = [k for k in a if k.startswith("master.")]
    assert len(masters) == 11 and all(a[k].dtype == mx.float32 for k in masters)
    assert set(a) == set(b)
    for k in a:
        assert mx.array_equal(a[k], b[k]), f"{k} changed in the N=2 -> N=3 round trip"


@pytest.mark.parametrize("mode", ["local", "sharded"])
def test_one_process_accumulation_is_one_step_on_the_whole_batch(mode):
    model, ref_model = _model(), _model()
    model.set_dtype(mx.float32), ref_model.set_dtype(mx.float32)
    opt = mlx_fsdp.fsdp_step(optim.Adam(learning_rate=1e-2), grad_accumulation_steps=2,
                             accumulation=mode)
    ref = optim.Adam(learning_rate=1e-2)
    x = mx.random.normal((8, 6), key=mx.random.key(3))
    y = mx.arange(8) % 3
    for half in (slice(0, 4), slice(4, 8)):
        _, g = nn.value_and_grad(model, _loss)(model, x[half], y[half])
        opt.update(model, g)
        mx.eval(model.parameters(), opt.state)
    _, g = nn.value_and_grad(ref_model, _loss)(ref_model, x, y)
    ref.update(ref_model, g)
    mx.eval(ref_model.parameters())
    for (k, a), (_, b) in zip(nn.utils.tree_flatten(model.parameters()),
                              nn.utils.tree_flatten(ref_model.parameters())):
        assert mx.abs(a - b).max().item() <= 1e-5, k
    assert opt.step.item() == 1 and opt.micro_step == 0
