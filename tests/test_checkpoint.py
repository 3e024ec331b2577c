"""Sharded checkpoints: resharding, exact resume, consolidation, bad input, atomicity.

The references are plain ``mlx.optimizers`` runs in one process on the same
global batches (each rank of a sharded run takes its slice of them).
"""

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_unflatten

import mlx_fsdp
from launch import ROOT, run_ranks
from mlx_fsdp.checkpoint import atomic, save
from workers.ckpt_common import by_key_diff, make_optimizer, train
from workers.common import make_model

F32_TOL = 1e-5
STEPS, MORE = 3, 2


def _resume_ok(r, saved_world):
    assert r["saved_world"] == saved_world and r["user"] == {"note": "test"}, r
    assert r["loaded_weights"] <= F32_TOL and r["loaded_state"] <= F32_TOL, r
    assert r["step_after_load"] == STEPS and r["step"] == STEPS + MORE, r
    assert r["lr"] == pytest.approx(r["ref_lr"], rel=1e-6), r
    assert r["final"] <= F32_TOL, r


@pytest.fixture(scope="module")
def saved_n2(tmp_path_factory):
    """AdamW with a cosine schedule, 3 steps at N=2 with one bucket per array."""
    path = str(tmp_path_factory.mktemp("ckpt") / "n2")
    (r,) = run_ranks(2, "checkpoint.py", ["save", path, "adamw", STEPS, 0, "fsdp"])
    assert r["step"] == STEPS and r["buckets"] == 11, r
    return path


@pytest.mark.parametrize("n, wrap", [(3, "fsdp"), (1, "plain"), (2, "ddp")])
def test_resume_from_n2_ends_where_the_uninterrupted_run_ends(saved_n2, n, wrap):
    (r,) = run_ranks(n, "checkpoint.py", ["resume", saved_n2, "adamw", STEPS, MORE, wrap])
    _resume_ok(r, 2)


@pytest.mark.parametrize("saved, loaded", [(3, 2), (4, 2)])
def test_reshard_down_from_mpi(tmp_path, saved, loaded):
    path = str(tmp_path / "ck")
    run_ranks(saved, "checkpoint.py", ["save", path, "adamw", STEPS, 0, "fsdp"])
    (r,) = run_ranks(loaded, "checkpoint.py", ["resume", path, "adamw", STEPS, MORE, "fsdp"])
    _resume_ok(r, saved)


@pytest.mark.parametrize("n, wrap", [(3, "fsdp"), (1, "plain")])
def test_owner_placed_muon_state_reshards(tmp_path, n, wrap):
    # Saved at N=2 with tiny buckets: each Muon matrix's state lives whole on
    # its owner rank; it must come back whole on the new owner (or in the
    # plain layout) and continue exactly.
    path = str(tmp_path / "ck")
    (r,) = run_ranks(2, "checkpoint.py", ["save", path, "muon", STEPS, 0, "fsdp"])
    assert r["step"] == STEPS, r
    (r,) = run_ranks(n, "checkpoint.py", ["resume", path, "muon", STEPS, MORE, wrap])
    _resume_ok(r, 2)


def test_multioptimizer_and_ddp_checkpoint_reshard(tmp_path):
    # A MultiOptimizer (AdamW on matrices, SGD on the rest), each with its own
    # state and step; saved from ddp_step (plain layout), loaded sharded.
    path = str(tmp_path / "multi")
    run_ranks(2, "checkpoint.py", ["save", path, "multi", STEPS, 300, "ddp"])
    (r,) = run_ranks(3, "checkpoint.py", ["resume", path, "multi", STEPS, MORE, "fsdp"])
    _resume_ok(r, 2)
    path = str(tmp_path / "multi_fsdp")
    run_ranks(2, "checkpoint.py", ["save", path, "multi", STEPS, 300, "fsdp"])
    (r,) = run_ranks(1, "checkpoint.py", ["resume", path, "multi", STEPS, MORE, "plain"])
    _resume_ok(r, 2)


def test_manifest_is_plain_json(saved_n2):
    with open(os.path.join(saved_n2, "manifest.json")) as f:
        m = json.load(f)
    assert m["world_size"] == 2 and m["step"] == STEPS and m["layout"]["num_shards"] == 2
    assert m["optimizer"]["class"] == "AdamW"
    assert m["optimizer"]["hyperparameters"]["weight_decay"] == 0.05
    assert m["optimizer"]["scheduled"] == ["learning_rate"]
    assert m["mlx_version"] == mx.__version__
    assert len(m["plan"]["buckets"]) == 11
    mix = m["optimizers"][0]["parameters"]["mix"]
    entry = mix["entries"]["m"]
    assert (mix["shape"], mix["size"], entry["kind"], entry["order"]) == ([7, 15], 105, "pieces", "F")
    assert entry["ranks"] == [0, 1] and m["format_version"] == 3
    assert set(m["files"]) == {"model.safetensors", "optimizer-00000-of-00002.safetensors",
                               "optimizer-00001-of-00002.safetensors"}
    # Rebuild one entry following only the manifest's layout note (the holders'
    # pieces in rank order; order 'F': reshape to the reversed shape and
    # transpose); it is plain MLX's state.
    pieces = [mx.load(os.path.join(saved_n2, f"optimizer-0000{r}-of-00002.safetensors"))
              ["state/0/mix/m"] for r in entry["ranks"]]
    assert [p.size for p in pieces] == [53, 52]
    assert "order 'F'" in m["layout"]["how_to_read"]
    rebuilt = mx.concatenate(pieces).reshape(15, 7).T
    _, ref = _plain_reference()
    assert mx.abs(rebuilt - ref.state["mix"]["m"]).max().item() <= 1e-5


def _plain_reference(steps=STEPS):
    model, opt = make_model(bf16=False), make_optimizer("adamw")
    train(model, opt, steps)
    return model, opt


def test_consolidate_cli_gives_the_plain_optimizer_state(saved_n2, tmp_path):
    out = str(tmp_path / "full.safetensors")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "mlx_fsdp.checkpoint", "consolidate", saved_n2, out],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    arrays = mx.load(out)
    ref_model, ref_opt = _plain_reference()
    # The documented recipe, with plain MLX only.
    model, opt = make_model(seed=5, bf16=False), make_optimizer("adamw")
    model.load_weights([(k[6:], v) for k, v in arrays.items() if k.startswith("model.")])
    opt.state = tree_unflatten([(k[10:], v) for k, v in arrays.items() if k.startswith("optimizer.")])
    assert by_key_diff(opt.state, ref_opt.state) <= F32_TOL
    assert by_key_diff(model.parameters(), ref_model.parameters()) <= F32_TOL
    train(model, opt, MORE, start=STEPS)
    train(ref_model, ref_opt, MORE, start=STEPS)
    assert by_key_diff(model.parameters(), ref_model.parameters()) <= F32_TOL


def test_consolidate_cli_reports_a_damaged_checkpoint(saved_n2, tmp_path):
    path = str(tmp_path / "ck")
    shutil.copytree(saved_n2, path)
    os.remove(os.path.join(path, "optimizer-00001-of-00002.safetensors"))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "mlx_fsdp.checkpoint", "consolidate", path,
                           str(tmp_path / "o")], capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and "missing optimizer-00001-of-00002" in proc.stderr


# --- bad input: a clear error, and neither the model nor the optimizer changes ---

def _damage(kind, path):
    shard = os.path.join(path, "optimizer-00001-of-00002.safetensors")
    if kind == "missing":
        os.remove(shard)
    elif kind == "truncated":
        with open(shard, "rb+") as f:
            f.truncate(os.path.getsize(shard) - 10)
    elif kind == "altered":
        with open(shard, "rb+") as f:
            f.seek(os.path.getsize(shard) - 5)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 1]))


BAD = {
    "missing": "missing optimizer-00001-of-00002.safetensors",
    "truncated": "the file is truncated or altered",
    "altered": "does not match its sha256",
}


def _trained():
    model, opt = make_model(seed=9, bf16=False), make_optimizer("adamw")
    train(model, opt, 1)
    return model, opt, tree_flatten(model.parameters()), tree_flatten(opt.state)


def _unchanged(model, opt, params, state):
    return (by_key_diff(model.parameters(), tree_unflatten(params)) == 0.0
            and by_key_diff(opt.state, tree_unflatten(state)) == 0.0)


@pytest.mark.parametrize("kind", list(BAD))
def test_damaged_files_are_named_and_nothing_changes(saved_n2, tmp_path, kind):
    path = str(tmp_path / "ck")
    shutil.copytree(saved_n2, path)
    _damage(kind, path)
    model, opt, params, state = _trained()
    with pytest.raises(mlx_fsdp.CheckpointError, match=BAD[kind]):
        mlx_fsdp.load_checkpoint(path, model, opt)
    assert _unchanged(model, opt, params, state)


def test_damaged_shard_fails_on_every_rank(saved_n2, tmp_path):
    path = str(tmp_path / "ck")
    shutil.copytree(saved_n2, path)
    _damage("altered", path)
    code, out = run_ranks(2, "checkpoint.py", ["bad_load", path], timeout=120, expect_failure=True)
    for rank in (0, 1):
        assert f"rank {rank}: CheckpointError: optimizer-00001-of-00002.safetensors" in out, out
        assert f"rank {rank}: untouched=True" in out, out
    assert "NO ERROR" not in out


def test_different_model_is_refused(saved_n2):
    import mlx.nn as nn

    model, opt, params, state = _trained()
    model.proj = mx.zeros((15, 4))
    model.out = nn.Linear(17, 6)
    params, state = tree_flatten(model.parameters()), tree_flatten(opt.state)
    with pytest.raises(mlx_fsdp.CheckpointError, match=r"different model .*proj: \(15, 3\) float32 "
                       r"saved, \(15, 4\) float32 here"):
        mlx_fsdp.load_checkpoint(saved_n2, model, opt)
    assert _unchanged(model, opt, params, state)
    model, opt, params, state = _trained()
    model.extra = mx.zeros((3,))
    with pytest.raises(mlx_fsdp.CheckpointError, match="only in this model: extra"):
        mlx_fsdp.load_checkpoint(saved_n2, model, opt)


def test_different_optimizer_class_is_refused(saved_n2):
    model, _, params, _ = _trained()
    opt = optim.SGD(learning_rate=0.1, momentum=0.9)
    opt.init(model.trainable_parameters())
    state = tree_flatten(opt.state)
    with pytest.raises(mlx_fsdp.CheckpointError, match="holds the state of AdamW, but the "
                       "optimizer given is SGD"):
        mlx_fsdp.load_checkpoint(saved_n2, model, mlx_fsdp.fsdp_step(opt))
    assert _unchanged(model, opt, params, state)


def test_different_trainable_set_is_refused(saved_n2):
    model, opt, _, _ = _trained()
    model.inp.freeze()
    with pytest.raises(mlx_fsdp.CheckpointError, match=r"only here \[\]"):
        mlx_fsdp.load_checkpoint(saved_n2, model, opt)


def test_not_a_checkpoint(tmp_path):
    model, opt, _, _ = _trained()
    with pytest.raises(mlx_fsdp.CheckpointError, match="does not exist"):
        mlx_fsdp.load_checkpoint(str(tmp_path / "nothing"), model, opt)
    os.makedirs(tmp_path / "junk")
    (tmp_path / "junk" / "file").write_text("x")
    with pytest.raises(ValueError, match="is not an mlx_fsdp checkpoint"):
        mlx_fsdp.save_checkpoint(str(tmp_path / "junk"), model, opt)
    assert (tmp_path / "junk" / "file").read_text() == "x"


# --- atomicity ---

def _save_plain(path, steps):
    model, opt = make_model(bf16=False), make_optimizer("adamw")
    train(model, opt, steps)
    mlx_fsdp.save_checkpoint(path, model, opt)
    return model, opt


def _step_of(path):
    model, opt = make_model(seed=3, bf16=False), make_optimizer("adamw")
    return mlx_fsdp.load_checkpoint(path, model, opt)["step"]


@pytest.mark.parametrize("where", ["writing", "committing"])
def test_failed_save_keeps_the_old_checkpoint(tmp_path, monkeypatch, where):
    path = str(tmp_path / "ck")
    _save_plain(path, 1)
    model, opt = make_model(bf16=False), make_optimizer("adamw")
    train(model, opt, 2)

    def fail(*args):
        raise OSError("disk full (simulated)")

    if where == "writing":
        real = save._write
        monkeypatch.setattr(save, "_write", lambda f, a: real(f, a) if "model" in f else fail())
    else:
        monkeypatch.setattr(atomic, "commit", fail)
    with pytest.raises(RuntimeError, match=f"failed while {where} on rank.*previous checkpoint"):
        mlx_fsdp.save_checkpoint(path, model, opt)
    assert _step_of(path) == 1
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_crash_mid_save_never_looks_complete(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    _save_plain(path, 1)
    model, opt = make_model(bf16=False), make_optimizer("adamw")
    train(model, opt, 2)

    def killed(*args):  # not an Exception: nothing cleans up, as after a kill
        raise KeyboardInterrupt

    monkeypatch.setattr(save, "write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        mlx_fsdp.save_checkpoint(path, model, opt)
    partial = tmp_path / ".ck.partial"
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    with pytest.raises(mlx_fsdp.CheckpointError, match="has no manifest"):
        mlx_fsdp.load_checkpoint(str(partial), model, opt)
    assert _step_of(path) == 1
    monkeypatch.undo()
    mlx_fsdp.save_checkpoint(path, model, opt)  # the next save cleans up
    assert _step_of(path) == 2 and sorted(os.listdir(tmp_path)) == ["ck"]


def test_interrupted_swap_points_at_the_old_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    _save_plain(path, 1)
    os.rename(path, str(tmp_path / ".ck.old"))  # as if killed between the two renames
    model, opt = make_model(bf16=False), make_optimizer("adamw")
    with pytest.raises(mlx_fsdp.CheckpointError, match=r"previous checkpoint is intact at .*\.ck\.old"):
        mlx_fsdp.load_checkpoint(path, model, opt)


def test_failed_write_on_one_rank_fails_every_rank(saved_n2, tmp_path):
    path = str(tmp_path / "ck")
    shutil.copytree(saved_n2, path)
    code, out = run_ranks(2, "checkpoint.py", ["fail_save", path], timeout=120, expect_failure=True)
    for rank in (0, 1):
        assert f"rank {rank}: RuntimeError: Saving the checkpoint {path} failed while writing on " \
               "rank(s) [1]" in out, out
    assert "NO ERROR" not in out
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert _step_of_n2(path) == STEPS


def _step_of_n2(path):
    from mlx_fsdp.checkpoint.reader import read_manifest, verify_files

    m = read_manifest(path)
    verify_files(path, m)
    return m["step"]


def test_rebuild_reads_every_format_and_version_1_manifests(tmp_path):
    from mlx_fsdp.checkpoint.layout import _rebuild
    from mlx_fsdp.checkpoint.manifest import CheckpointError, shard_file
    from mlx_fsdp.checkpoint.reader import read_manifest

    a = mx.arange(35, dtype=mx.float32).reshape(7, 5)
    by_columns = mx.concatenate([a.T.reshape(-1), mx.zeros(1)])  # 2 shards of 18
    by_rows = mx.concatenate([a.reshape(-1), mx.zeros(1)])
    for flat, entry in ((by_columns, {"order": "F"}), (by_rows, {"order": "C"}), (by_rows, {})):
        files = {shard_file(r, 2): {"k": flat[18 * r:18 * (r + 1)]} for r in range(2)}
        entry.update(kind="flat", shape=[7, 5], source=0)
        assert mx.array_equal(_rebuild("k", entry, 35, files, 2), a), entry
    # Format 3: the pieces of the ranks that hold some of the array, in order.
    flat = a.T.reshape(-1)
    files = {shard_file(0, 3): {}, shard_file(1, 3): {"k": flat[:10]}, shard_file(2, 3): {"k": flat[10:]}}
    entry = {"kind": "pieces", "ranks": [1, 2], "order": "F", "shape": [7, 5]}
    assert mx.array_equal(_rebuild("k", entry, 35, files, 3), a)
    # A version-1 manifest (no "order": rows throughout) is read; an unknown version is not.
    model, opt = make_model(bf16=False), mlx_fsdp.fsdp_step(make_optimizer("adamw"))
    train(model, opt, 1)
    mlx_fsdp.save_checkpoint(str(tmp_path / "ck"), model, opt)
    path = str(tmp_path / "ck" / "manifest.json")
    m = json.load(open(path))
    for version, ok in ((1, True), (5, False)):
        m["format_version"] = version
        json.dump(m, open(path, "w"))
        if ok:
            assert read_manifest(str(tmp_path / "ck"))["format_version"] == 1
        else:
            with pytest.raises(CheckpointError, match="format_version=5; this mlx_fsdp reads versions 1, 2, 3, 4"):
                read_manifest(str(tmp_path / "ck"))


def test_one_process_wrappers_round_trip_exactly(tmp_path):
    # At N=1 the wrappers hold the plain state: save and load are exact.
    for wrap in (mlx_fsdp.fsdp_step, mlx_fsdp.ddp_step):
        model, opt = make_model(bf16=True), wrap(make_optimizer("multi"))
        train(model, opt, 2)
        mlx_fsdp.save_checkpoint(str(tmp_path / "ck"), model, opt)
        model2, opt2 = make_model(seed=4, bf16=True), wrap(make_optimizer("multi"))
        mlx_fsdp.load_checkpoint(str(tmp_path / "ck"), model2, opt2)
        assert by_key_diff(model.parameters(), model2.parameters()) == 0.0
        assert by_key_diff(opt.state, opt2.state) == 0.0
        train(model, opt, 1, start=2)
        train(model2, opt2, 1, start=2)
        assert by_key_diff(model.parameters(), model2.parameters()) == 0.0


@pytest.mark.parametrize("make", [lambda: optim.Adafactor(learning_rate=1e-2),
                                  lambda: optim.Muon(learning_rate=1e-2)])
def test_shape_aware_state_round_trips_whole(tmp_path, make):
    # Adafactor's factored second moment is not parameter-shaped: it is stored
    # whole (kind "whole") and comes back as it was.
    model, opt = make_model(bf16=False), make()
    train(model, opt, 2)
    mlx_fsdp.save_checkpoint(str(tmp_path / "ck"), model, opt)
    model2, opt2 = make_model(seed=4, bf16=False), make()
    mlx_fsdp.load_checkpoint(str(tmp_path / "ck"), model2, opt2)
    assert by_key_diff(opt.state, opt2.state) == 0.0
    train(model, opt, 1, start=2)
    train(model2, opt2, 1, start=2)
    assert by_key_diff(model.parameters(), model2.parameters()) == 0.0


# --- weights="trainable": the frozen base is not copied into every checkpoint ---

def _fine_tuned(seed):
    """A model whose base is frozen (same weights for every seed) and whose head trains."""
    model = make_model(seed=0, bf16=False)
    model.freeze()
    model.out.unfreeze()
    mx.random.seed(seed)
    model.out.update({"weight": mx.random.normal(model.out.weight.shape) * 0.1})
    mx.eval(model.parameters())
    return model


def test_trainable_weights_only(tmp_path):
    path = str(tmp_path / "adapter")
    model, opt = _fine_tuned(1), make_optimizer("adamw")
    train(model, opt, 2)
    mlx_fsdp.save_checkpoint(path, model, opt, weights="trainable")
    m = json.load(open(os.path.join(path, "manifest.json")))
    assert m["model"]["weights"] == "trainable" and m["format_version"] == 3
    assert m["model"]["stored"] == ["out.weight", "out.bias"]
    assert len(m["model"]["parameters"]) == len(tree_flatten(model.parameters()))
    assert sorted(mx.load(os.path.join(path, "model.safetensors"))) == ["out.bias", "out.weight"]

    # Loads into the same frozen base: the head and the state come back, the
    # base keeps its own values.
    model2, opt2 = _fine_tuned(2), make_optimizer("adamw")
    model2.inp.weight = model2.inp.weight + 1  # not in the checkpoint: must stay
    base = mx.array(model2.inp.weight)
    mlx_fsdp.load_checkpoint(path, model2, opt2)
    assert mx.array_equal(model2.inp.weight, base).item()
    assert by_key_diff(model2.out.parameters(), model.out.parameters()) == 0.0
    assert by_key_diff(opt2.state, opt.state) == 0.0
    model2.inp.weight = model.inp.weight  # the same base: the run continues exactly
    train(model, opt, 1, start=2)
    train(model2, opt2, 1, start=2)
    assert by_key_diff(model2.out.parameters(), model.out.parameters()) == 0.0

    # The parameters it does not hold must still exist with the saved shapes.
    model3, opt3 = _fine_tuned(2), make_optimizer("adamw")
    model3.proj = mx.zeros((15, 4))
    with pytest.raises(mlx_fsdp.CheckpointError, match=r"different model .*proj: \(15, 3\)"):
        mlx_fsdp.load_checkpoint(path, model3, opt3)

    # Consolidated: model.* holds the trainable parameters only.
    out = mlx_fsdp.consolidate_checkpoint(path, str(tmp_path / "full"))
    assert sorted(k for k in mx.load(out) if k.startswith("model.")) == ["model.out.bias",
                                                                          "model.out.weight"]
    with pytest.raises(ValueError, match="weights='some' must be 'all'"):
        mlx_fsdp.save_checkpoint(path, model, opt, weights="some")
