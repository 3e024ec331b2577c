"""``python -m mlx_fsdp.lora`` against mlx-lm's own ``mlx_lm.lora``, on tiny models built here.

Nothing is downloaded: a Llama (full precision and 4-bit) and a Qwen3 with
random weights, a word-level tokenizer and jsonl data are written once per
session with mlx-lm's own save functions (``mlx_fsdp.lm.tiny``). The runs go
over more than two passes of the training data, with evaluations in between
and LoRA dropout, so the batch order, the evaluation draws and the random key
all matter for resuming.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from launch import ROOT, run_ranks, run_script  # noqa: E402

TOL = 1e-5
ITERS, SAVE_EVERY = 8, 4

# name: (model directory, fine-tune type, LoRA dropout, flags of both runs, flags of
# ours). The reference runs mlx_lm.lora with the same model, type, dropout and flags.
RUNS = {
    "lora": ("llama", "lora", 0.0, [], ["--communication-size", "1KiB"]),
    "qlora": ("llama-4bit", "lora", 0.0, [], []),
    "full": ("qwen3", "full", 0.0, [], []),
    # Dropout draws from MLX's random key in every step: resuming must restore it.
    "dropout": ("llama", "lora", 0.1, [], []),
    # fsdp_step's sharded accumulation inside mlx-lm's compiled step, against
    # mlx-lm's own accumulation of full gradients.
    "accumulate": ("llama", "lora", 0.0, ["--grad-accumulation-steps", "2"],
                   ["--accumulation", "sharded"]),
    # Parameters sharded too (fully_shard on each block, then the model), against the
    # reference run of the same name without "-sharded": a full fine-tune whose blocks are
    # recomputed in the backward pass (Qwen3 ties its head to the embedding), and QLoRA
    # (frozen and trainable arrays in one module, quantized weights kept whole).
    "full-sharded": ("qwen3", "full", 0.0, [], ["--fully-shard", "--reshard-after-forward"]),
    "qlora-sharded": ("llama-4bit", "lora", 0.0, [], ["--fully-shard"]),
}

#: The mlx_lm.lora run each of ours is compared with: the same flags, less our own.
REFERENCE = {name: name.removesuffix("-sharded") for name in RUNS}


@pytest.fixture(scope="module", autouse=True)
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """Model directories and data, written once: {"llama": path, ..., "data": path, "yaml": path}."""
    from mlx_fsdp.lm.tiny import write_data, write_model

    root = tmp_path_factory.mktemp("lm_files")
    out = {name: str(root / name) for name in ("llama", "llama-4bit", "qwen3", "data")}
    write_model(out["llama"], model_type="llama", hidden_size=32, layers=2, seed=1)
    write_model(out["llama-4bit"], model_type="llama", hidden_size=32, layers=2, seed=1,
                quantize_bits=4, group_size=32)
    write_model(out["qwen3"], model_type="qwen3", hidden_size=32, layers=2, seed=2)
    # 18 lines in batches of 6: 3 batches per pass, so 8 iterations cross two passes.
    write_data(out["data"], train=18, valid=12, test=6)
    for dropout in (0.0, 0.1):
        # LoRA settings through mlx_lm.lora's YAML --config, which we read too.
        out[dropout] = str(root / f"lora-{dropout}.yaml")
        with open(out[dropout], "w") as fh:
            fh.write(f"lora_parameters:\n  rank: 4\n  dropout: {dropout}\n  scale: 10.0\n")
    return out


def flags(files, name: str, adapter_path: str):
    """``mlx_lm.lora`` flags of the run ``name``, shared by the reference and ours."""
    model, kind, dropout, shared, _ = RUNS[name]
    return [*shared, "--model", files[model], "--data", files["data"], "--train",
            "--fine-tune-type", kind, "--optimizer", "adamw", "--config", files[dropout],
            "--num-layers", "2", "--batch-size", "6", "--iters", ITERS,
            "--learning-rate", "1e-3", "--steps-per-report", "1", "--steps-per-eval", "2",
            "--val-batches", "2", "--save-every", SAVE_EVERY, "--seed", "3",
            "--adapter-path", adapter_path]


def runs(files, names, paths: dict, ours: bool) -> list:
    """The command line of the runs ``names`` in one process (see workers/lm_cli.py)."""
    args = []
    for name in names:
        args += flags(files, name, paths[name]) + (RUNS[name][4] if ours else []) + ["---"]
    return args[:-1]


def read_log(adapter_path: str):
    with open(os.path.join(adapter_path, "losses.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return [(r["kind"], r["iteration"], r.get("train_loss", r.get("val_loss"))) for r in rows]


def assert_same_losses(ours, reference, resumed_at: int = 0):
    """The same training losses, and validation losses where both evaluated.

    mlx-lm's trainer evaluates on the first iteration of every ``train`` call
    and every ``--steps-per-eval`` iterations counted from there, so a run
    resumed at ``resumed_at`` may evaluate at other iterations (training is
    the same); otherwise both must report at the same iterations.
    """
    if not resumed_at:
        assert [r[:2] for r in ours] == [r[:2] for r in reference]
    assert [r[1] for r in ours if r[0] == "train"] == [r[1] for r in reference if r[0] == "train"]
    ref = {r[:2]: r[2] for r in reference}
    worst = max(abs(r[2] - ref[r[:2]]) for r in ours if r[:2] in ref)
    assert worst <= TOL, f"largest loss difference {worst:.3g}:\n{ours}\n{reference}"


def assert_same_weights(path_a: str, path_b: str):
    a, b = mx.load(path_a), mx.load(path_b)
    assert sorted(a) == sorted(b)
    for k in a:
        assert mx.allclose(a[k], b[k], rtol=0, atol=TOL).item(), k


def launch(n: int, script: str, args) -> str:
    """run_script, failing also when a rank failed (mlx.launch exits 0 then)."""
    out = run_script(n, f"tests/workers/{script}", args, timeout=300)
    assert "Traceback" not in out and "exited with code" not in out, out[-6000:]
    return out


@pytest.fixture(scope="session")
def reference(files, tmp_path_factory):
    """mlx-lm's own ``mlx_lm.lora`` DDP runs on 2 ranks, one launch: {name: adapter path}."""
    root = tmp_path_factory.mktemp("lm_reference")
    paths = {name: str(root / REFERENCE[name]) for name in RUNS}
    launch(2, "lm_reference.py", runs(files, dict.fromkeys(REFERENCE.values()), paths, ours=False))
    return paths


@pytest.fixture(scope="session")
def ours(files, tmp_path_factory):
    """``python -m mlx_fsdp.lora`` on 2 ranks, one launch: {name: adapter path}."""
    root = tmp_path_factory.mktemp("lm_ours")
    paths = {name: str(root / name) for name in RUNS}
    launch(2, "lm_cli.py", runs(files, RUNS, paths, ours=True))
    return paths


@pytest.mark.parametrize("name", list(RUNS))
def test_cli_equals_mlx_lm_lora(name, ours, reference):
    """Loss for loss (training and validation) and the saved adapters, against mlx_lm.lora at N=2."""
    assert_same_losses(read_log(ours[name]), read_log(reference[name]))
    for file in ("adapters.safetensors", f"{SAVE_EVERY:07d}_adapters.safetensors",
                 f"{ITERS:07d}_adapters.safetensors"):
        assert_same_weights(os.path.join(ours[name], file), os.path.join(reference[name], file))
    with open(os.path.join(ours[name], "adapter_config.json")) as fh:
        config = json.load(fh)
    assert config["fine_tune_type"] == RUNS[name][1] and config["fsdp"] is True
    assert config["fully_shard"] is ("--fully-shard" in RUNS[name][4])


def model_shards(checkpoint: str) -> list:
    """The model shard files in ``checkpoint``: one per rank for a fully sharded model."""
    return sorted(f for f in os.listdir(checkpoint) if f.startswith("model-"))


@pytest.mark.parametrize("name", ["lora", "full-sharded"])
def test_cli_saves_sharded_checkpoints(name, ours):
    """Every --save-every and at the end; with --fully-shard each rank writes the parameter
    rows it holds to its own file, and no file holds a whole trained matrix."""
    from mlx_fsdp.lm.checkpoints import latest

    ckpt = os.path.join(ours[name], "checkpoints")
    assert sorted(os.listdir(ckpt)) == [f"step-{SAVE_EVERY:07d}", f"step-{ITERS:07d}"]
    assert latest(ckpt).endswith(f"step-{ITERS:07d}")
    saved = os.path.join(ckpt, f"step-{SAVE_EVERY:07d}")
    with open(os.path.join(saved, "manifest.json")) as fh:
        manifest = json.load(fh)
    assert manifest["world_size"] == 2
    assert manifest["user"]["iteration"] == SAVE_EVERY
    assert manifest["user"]["batch_size"] == 6
    if name == "lora":
        assert model_shards(saved) == []
        return
    shards = model_shards(saved)
    assert shards == [f"model-0000{r}-of-00002.safetensors" for r in range(2)]
    whole = mx.load(os.path.join(ours[name], f"{SAVE_EVERY:07d}_adapters.safetensors"))
    for file in shards:
        held = mx.load(os.path.join(saved, file))
        assert held and all(held[k].size < whole[k].size for k in held if whole[k].ndim == 2)


# Resumed from the N=2 runs of `ours` after iteration 4 (mid-pass), one launch per N:
# {N: [(run, flags of ours for the resumed run), ...]}. Dropout masks are drawn per rank
# for the rank's own rows, so a run with dropout depends on N: it resumes at N=2, which
# checks that MLX's random key carries over. Checkpoints of fully sharded models resume
# at another N with --fully-shard, and at N=2 without it; the accumulating run, saved
# without --fully-shard, resumes with it (--fully-shard with --accumulation sharded).
RESUMES = {
    3: [("lora", RUNS["lora"][4]), ("full-sharded", RUNS["full-sharded"][4]),
        ("accumulate", RUNS["accumulate"][4] + ["--fully-shard"])],
    1: [("lora", RUNS["lora"][4] + ["--no-fsdp"])],
    2: [("dropout", []), ("qlora-sharded", [])],
}


@pytest.mark.parametrize("n", list(RESUMES))
def test_resume(n, files, ours, reference, tmp_path):
    """Saved at N=2 after iteration 4, resumed at N=3 (MPI), at N=1 under ddp_step, or at
    N=2, with or without --fully-shard: each run ends where mlx_lm.lora's uninterrupted
    N=2 run ends (losses and adapters)."""
    paths, args = [], []
    for i, (name, ours_flags) in enumerate(RESUMES[n]):
        path = str(tmp_path / f"{i}-{name}")
        shutil.copytree(ours[name], path)
        shutil.rmtree(os.path.join(path, "checkpoints", f"step-{ITERS:07d}"))
        paths.append(path)
        args += flags(files, name, path) + ours_flags + ["--resume", "---"]
    out = launch(n, "lm_cli.py", args[:-1])
    assert out.count(f"iteration {SAVE_EVERY} of {ITERS}") == len(paths)
    for (name, _), path in zip(RESUMES[n], paths):
        assert_same_losses(read_log(path), read_log(reference[name]), resumed_at=SAVE_EVERY)
        for file in ("adapters.safetensors", f"{ITERS:07d}_adapters.safetensors"):
            assert_same_weights(os.path.join(path, file), os.path.join(reference[name], file))


def test_fully_sharded_at_three_ranks(files, reference, ours, tmp_path):
    """--fully-shard at N=3 (MPI; 32 rows do not divide by 3) gives mlx_lm.lora's N=2 losses
    and weights (equal-length examples: the loss does not depend on N); each of its
    checkpoints has one model shard file per rank."""
    path = str(tmp_path / "full-sharded")
    launch(3, "lm_cli.py", flags(files, "full-sharded", path) + RUNS["full-sharded"][4])
    for step in (SAVE_EVERY, ITERS):
        assert model_shards(os.path.join(path, "checkpoints", f"step-{step:07d}")) == [
            f"model-0000{r}-of-00003.safetensors" for r in range(3)]
    assert_same_losses(read_log(path), read_log(reference["full-sharded"]))
    for file in ("adapters.safetensors", f"{ITERS:07d}_adapters.safetensors"):
        assert_same_weights(os.path.join(path, file), os.path.join(reference["full-sharded"], file))


def _logits(model, tokens):
    return model(mx.array([tokens]))


@pytest.mark.parametrize("name", ["lora", "qlora"])
def test_adapters_load_and_fuse_with_mlx_lm(name, files, ours, tmp_path):
    """mlx-lm's loader applies the adapters; mlx_lm.fuse fuses them into the same model
    (dequantized for QLoRA: fusing into 4-bit weights rounds)."""
    from mlx_lm import generate, load

    base = files[RUNS[name][0]]
    model, tokenizer = load(base, adapter_path=ours[name])
    saved = mx.load(os.path.join(ours[name], "adapters.safetensors"))
    params = dict(tree_flatten(model.parameters()))
    assert saved and all(mx.array_equal(params[k], v).item() for k, v in saved.items())
    tokens = tokenizer.encode("the cat runs over the river")
    fused_path = str(tmp_path / "fused")
    subprocess.run([sys.executable, "-m", "mlx_lm", "fuse", "--model", base,
                    "--adapter-path", ours[name], "--save-path", fused_path,
                    *(["--dequantize"] if name == "qlora" else [])],
                   check=True, capture_output=True, cwd=ROOT, timeout=120)
    fused, _ = load(fused_path)
    assert mx.allclose(_logits(fused, tokens), _logits(model, tokens), atol=1e-4).item()
    assert generate(model, tokenizer, "the cat", max_tokens=3)


@pytest.mark.parametrize("name", ["full", "full-sharded"])
def test_full_fine_tune_model_loads_with_mlx_lm(name, files, ours):
    """The full fine-tune writes ADAPTER_PATH/model, which mlx_lm.load opens as a model
    (with --fully-shard: the whole weights, gathered from the ranks' shards)."""
    from mlx_lm import load

    tuned, tokenizer = load(os.path.join(ours[name], "model"))
    via_adapters, _ = load(files["qwen3"], adapter_path=ours[name])
    tokens = tokenizer.encode("the dog sees a tree")
    assert mx.array_equal(_logits(tuned, tokens), _logits(via_adapters, tokens)).item()
    base, _ = load(files["qwen3"])
    assert not mx.allclose(_logits(base, tokens), _logits(tuned, tokens)).item()


def test_compiled_trainer_step_with_sharded_accumulation(files):
    """mlx-lm's compiled step with fsdp_step(grad_accumulation_steps=2, accumulation="sharded")
    equals mlx-lm's own accumulation (TrainingArgs.grad_accumulation_steps=2) on a plain optimizer."""
    [result] = run_ranks(2, "lm_accumulate.py", [files["llama"], files["data"]], timeout=300)
    assert result["iterations"] == 8
    assert result["max_loss_diff"] <= TOL
    assert result["max_param_diff"] <= TOL


def test_init_with_all_parameters_then_train(files):
    """opt.init(model.parameters()) on a LoRA and a QLoRA model, as plain optimizers allow, then
    mlx-lm's trainer: the same losses and adapters as a plain AdamW under mlx-lm's DDP."""
    results = run_ranks(2, "lm_init.py", [files["llama"], files["llama-4bit"], files["data"]],
                        timeout=300)
    assert len(results) == 2
    for result in results:
        assert "error" not in result, result
        assert result["iterations"] == 8
        assert result["max_loss_diff"] <= TOL and result["max_param_diff"] <= TOL, result


# ----------------------------------------------------------------------------- in one process


def _lora_run(files, path: str, iters: int, *, ours: bool = True, resume: bool = False,
              batch_size: int = 6, steps_per_save: int = 3, data: str = None):
    """mlx_fsdp.lm.train (or mlx-lm's own train, ``ours=False``) on LoRA in this process."""
    import types
    from pathlib import Path

    import mlx.optimizers as optim
    import numpy as np
    from mlx_lm import load
    from mlx_lm.tuner import trainer
    from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset
    from mlx_lm.tuner.utils import linear_to_lora_layers

    import mlx_fsdp.lm

    np.random.seed(0)
    mx.random.seed(0)
    model, tokenizer = load(files["llama"])
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "dropout": 0.0, "scale": 10.0})
    train_set, valid_set, _ = load_local_dataset(Path(data or files["data"]), tokenizer,
                                                 types.SimpleNamespace())
    os.makedirs(path, exist_ok=True)
    args = trainer.TrainingArgs(
        batch_size=batch_size, iters=iters, steps_per_report=1, steps_per_eval=4,
        steps_per_save=steps_per_save, val_batches=2,
        adapter_file=os.path.join(path, "adapters.safetensors"))
    data = dict(train_dataset=CacheDataset(train_set), val_dataset=CacheDataset(valid_set))
    log = os.path.join(path, "losses.jsonl")
    if ours:
        mlx_fsdp.lm.train(model, optim.AdamW(learning_rate=1e-3), args=args, **data,
                          checkpoint_dir=os.path.join(path, "checkpoints"), resume=resume,
                          log_file=log)
    else:
        from mlx_fsdp.lm.train import _Reports

        trainer.train(model, optim.AdamW(learning_rate=1e-3), args=args, **data,
                      training_callback=_Reports(None, 0, log, 0))
    return path


def test_train_in_one_process_is_mlx_lm_train(files, tmp_path):
    """At N=1 mlx_fsdp.lm.train gives mlx-lm's own train's losses and adapters, bit for bit."""
    ours = _lora_run(files, str(tmp_path / "ours"), 6)
    theirs = _lora_run(files, str(tmp_path / "theirs"), 6, ours=False)
    assert read_log(ours) == read_log(theirs)
    a, b = (mx.load(os.path.join(p, "adapters.safetensors")) for p in (ours, theirs))
    assert all(mx.array_equal(a[k], b[k]).item() for k in b)


def test_resume_at_pass_boundaries_and_past_the_end(files, tmp_path):
    """3 batches per pass, saved every 3, evaluated every 4: resuming at a pass boundary,
    where the resumed trainer evaluates at other iterations before later passes draw
    their order, and extending a finished run (whose last iteration evaluated off the
    longer run's schedule), end where one uninterrupted run ends."""
    full = _lora_run(files, str(tmp_path / "full"), 12)
    assert sorted(os.listdir(os.path.join(full, "checkpoints"))) == [
        f"step-{i:07d}" for i in (3, 6, 9, 12)]
    resumed = str(tmp_path / "resumed")
    shutil.copytree(full, resumed)
    for step in (6, 9, 12):
        shutil.rmtree(os.path.join(resumed, "checkpoints", f"step-{step:07d}"))
    _lora_run(files, resumed, 12, resume=True)
    extended = _lora_run(files, str(tmp_path / "extended"), 6)
    _lora_run(files, extended, 12, resume=True)
    for path, start in ((resumed, 3), (extended, 6)):
        assert_same_losses(read_log(path), read_log(full), resumed_at=start)
        assert_same_weights(os.path.join(path, "adapters.safetensors"),
                            os.path.join(full, "adapters.safetensors"))


def test_resume_refuses_what_cannot_continue(files, tmp_path):
    path = str(tmp_path / "run")
    with pytest.raises(ValueError, match="no checkpoint in checkpoint_dir"):
        _lora_run(files, path, 3, resume=True)
    _lora_run(files, path, 3)
    with pytest.raises(ValueError, match=r"batch_size=3 \(saved with 6\)"):
        _lora_run(files, path, 6, resume=True, batch_size=3)
    with pytest.raises(ValueError, match="past iters=2"):
        _lora_run(files, path, 2, resume=True)
    from mlx_fsdp.lm.tiny import write_data

    other = str(tmp_path / "other")
    write_data(other, train=24, valid=12)
    with pytest.raises(ValueError, match="4 batches per pass, but the run was saved with 3"):
        _lora_run(files, path, 6, resume=True, data=other)


def test_sharded_training_restores_mlx_lm():
    """The context manager swaps the trainer's all-reduce out and back, also on an error."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm.tuner import trainer

    import mlx_fsdp
    from mlx_fsdp.lm import sharded_training

    with sharded_training(optim.AdamW(learning_rate=1e-3), max_norm=1.0) as opt:
        assert isinstance(opt, mlx_fsdp.ShardedOptimizer) and opt.max_norm == 1.0
        grads = {"w": mx.ones((2,))}
        assert trainer.average_gradients(grads) is grads
    assert trainer.average_gradients is nn.average_gradients
    with pytest.raises(KeyError):
        with sharded_training(optim.SGD(learning_rate=0.1), fsdp=False) as opt:
            assert isinstance(opt, mlx_fsdp.ReplicatedOptimizer)
            raise KeyError("inside")
    assert trainer.average_gradients is nn.average_gradients
    with pytest.raises(ValueError, match="already an mlx_fsdp wrapper"):
        with sharded_training(mlx_fsdp.fsdp_step(optim.SGD(learning_rate=0.1)), max_norm=1.0):
            pass


def test_hooks_refuse_a_changed_mlx_lm(monkeypatch):
    """If mlx-lm no longer has what the hooks swap, they say so, naming the version."""
    import mlx_lm
    import mlx_lm.lora
    from mlx_lm.tuner import trainer

    from mlx_fsdp.lm.hooks import lora_train_replaced, trainer_all_reduce_removed

    with lora_train_replaced(print):
        assert mlx_lm.lora.train is print
    assert mlx_lm.lora.train is trainer.train
    monkeypatch.setattr(trainer, "average_gradients", lambda g: g)
    with pytest.raises(RuntimeError, match=f"mlx-lm {mlx_lm.__version__} changed "
                                           "mlx_lm.tuner.trainer.average_gradients"):
        with trainer_all_reduce_removed():
            pass
    monkeypatch.delattr(mlx_lm.lora, "train")
    with pytest.raises(RuntimeError, match="changed mlx_lm.lora.train"):
        with lora_train_replaced(print):
            pass
    # The lazy load, --test on the sharded model, and the weights written apart.
    import mlx_lm.utils

    from mlx_fsdp.lm.hooks import lora_loads_lazily, lora_tests_model, weights_written_apart

    with lora_loads_lazily():
        assert mlx_lm.lora.load.keywords == {"lazy": True}
    assert mlx_lm.lora.load is mlx_lm.utils.load
    seen = []
    monkeypatch.setattr(mlx_lm.lora, "evaluate_model", lambda *args: seen.append(args))
    with lora_tests_model({"model": "sharded"}):
        mlx_lm.lora.evaluate_model("args", "mlx-lm's model", "test set")
    with lora_tests_model({}):  # nothing trained here: mlx-lm's own model
        mlx_lm.lora.evaluate_model("args", "mlx-lm's model", "test set")
    assert seen == [("args", "sharded", "test set"), ("args", "mlx-lm's model", "test set")]
    for hook, name in ((lora_loads_lazily, "load"), (lora_tests_model, "evaluate_model")):
        monkeypatch.delattr(mlx_lm.lora, name, raising=False)
        with pytest.raises(RuntimeError, match=f"changed mlx_lm.lora.{name}"):
            with hook() if hook is lora_loads_lazily else hook({}):
                pass
    monkeypatch.delattr(mlx_lm.utils, "save_model")
    with pytest.raises(RuntimeError, match="changed mlx_lm.utils.save_model"):
        with weights_written_apart():
            pass


def test_a_changed_batch_order_is_refused():
    """ResumableBatches checks that permutations are drawn at pass starts only."""
    import numpy as np

    from mlx_fsdp.lm.position import ResumableBatches

    def draws_every_batch(dataset, batch_size, max_seq_length, loop=False, seed=None,
                          comm_group=None):
        while True:
            yield np.random.permutation(4)

    batches = ResumableBatches(draws_every_batch, steps_per_eval=10, iters=10)
    gen = batches(list(range(8)), 2, 16, loop=True)
    next(gen)
    with pytest.raises(RuntimeError, match="order of iterate_batches"):
        next(gen)


def test_cli_flags_and_yaml(tmp_path):
    """mlx_lm.lora's flags and YAML --config, plus ours; the command line wins over YAML."""
    from mlx_fsdp.lora import parse_args, parse_size

    config = tmp_path / "c.yaml"
    config.write_text("max_norm: 0.5\ncommunication_size: 1MiB\nfsdp: false\nbatch_size: 8\n")
    args = parse_args(["--model", "m", "--train", "--config", str(config), "--batch-size", "2"])
    assert (args.max_norm, args.communication_size, args.fsdp) == (0.5, 1024**2, False)
    assert (args.batch_size, args.fine_tune_type, args.resume) == (2, "lora", False)
    args = parse_args(["--model", "m", "--no-fsdp", "--communication-size", "512KiB",
                       "--master-dtype", "float32", "--resume", "--checkpoint-dir", "c"])
    assert (args.fsdp, args.communication_size, args.master_dtype) == (False, 512 * 1024, "float32")
    assert (args.resume, args.checkpoint_dir, args.communication_size) == (True, "c", 524288)
    # Without the flag the wrapper picks its own default (fsdp_step's depends on the device).
    assert parse_args(["--model", "m"]).communication_size is None
    assert parse_size("32M") == parse_size("32MiB") == 32 * 1024**2 and parse_size(7) == 7
    with pytest.raises(Exception, match="not a byte count"):
        parse_size("lots")


def test_fully_shard_refuses_what_cannot_work():
    """--fully-shard with ddp_step, and --reshard-after-forward alone, are refused before
    anything loads."""
    from mlx_fsdp.lora import main

    for extra, match in ((["--fully-shard", "--no-fsdp"], "ddp_step cannot step a fully sharded"),
                         (["--reshard-after-forward"], "needs fully_shard=True")):
        with pytest.raises(ValueError, match=match):
            main(["--model", "not-loaded", "--train", *extra])


def test_bench_lm_writes_its_table_and_json(tmp_path):
    """benchmarks/bench_lm.py in one process on a tiny Llama: every mode, equal losses."""
    md, js = tmp_path / "lm.md", tmp_path / "lm.json"
    out = run_script(1, "benchmarks/bench_lm.py",
                     ["--hidden", "32", "--layers", "1", "--steps", "2", "--warmup", "1",
                      "--markdown", md, "--json", js], timeout=300)
    assert "| fsdp-double |" in out and "| fsdp-double |" in md.read_text()
    record = json.loads(js.read_text())
    assert set(record["modes"]) == {"ddp", "fsdp", "fsdp-double"}
    for mode in record["modes"].values():
        assert mode["max_loss_diff_vs_first"] == 0.0 and mode["step_ms"] > 0


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_fully_sharded_run_never_holds_the_whole_model(kind, files, tmp_path):
    """--fully-shard loads the model lazily and shards it one block at a
    time, writes the fine-tuned weights from the shards one module at a
    time, and --test evaluates the sharded model: no rank holds the whole
    model at the start or at the end (before 2026-11-28 every rank loaded it
    whole, and gathered it whole to save or test it). Sixteen blocks of 128:
    each is 1/17 of the model; a rank keeps half."""
    from mlx_fsdp.lm.tiny import write_model

    model = str(tmp_path / "model")
    write_model(model, hidden_size=128, layers=16, seed=4)
    whole = sum(a.nbytes for a in mx.load(os.path.join(model, "model.safetensors")).values())
    # An earlier save there, named otherwise, must not mix into this one.
    os.makedirs(tmp_path / "run" / "model")
    shutil.copy(os.path.join(model, "model.safetensors"), tmp_path / "run" / "model")
    out = launch(2, "lm_memory.py", [
        "--model", model, "--data", files["data"], "--train", "--fine-tune-type", kind,
        "--num-layers", "-1", "--batch-size", "2", "--iters", "2", "--steps-per-eval", "100",
        "--val-batches", "1", "--fully-shard", "--reshard-after-forward", "--test",
        "--adapter-path", str(tmp_path / "run")])
    assert "Test loss" in out, out[-3000:]
    ranks = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
             if line.startswith("MEMORY ")]
    assert sorted(r["rank"] for r in ranks) == [0, 1], out[-3000:]
    for r in ranks:
        assert r["loaded"] < 0.8 * whole, (r, whole)
        assert r["testing"] < 0.4 * whole, (r, whole)
        if kind == "lora":  # little besides the model's shards when the test begins
            assert r["testing_from"] < 0.8 * whole, (r, whole)
        if kind == "full":
            assert r["saving"] < 0.4 * whole, (r, whole)
    if kind == "full":
        from mlx_lm import load
        assert not (tmp_path / "run" / "model" / "model.safetensors").exists()
        loaded, _ = load(str(tmp_path / "run" / "model"))
        assert sum(a.nbytes for _, a in tree_flatten(loaded.parameters())) == whole
