"""Checkpoints of fully sharded models: each rank writes its shards, and they reshard.

The references are plain ``mlx.optimizers`` runs in one process on the same
global batches (``workers/ckpt_common.py``), which a run at any world size
follows, and the row split that ``fully_shard`` documents (rank ``r`` holds
rows ``[r*k, min((r+1)*k, R))``, ``k = ceil(R/N)``), computed here. Three
launches: the saves at ring N=2, the resumes at MPI N=3 (which save again),
and the resumes of those at ring N=2.
"""

import json
import os
import shutil
import struct

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import mlx_fsdp
from launch import run_ranks
from workers.ckpt_fully_sharded import STEPS, build, reference, resume

F32_TOL = 1e-5
SAVED = ["muon:muon", "plain:plain", "ddp:ddp", "master:master", "adamw:adamw"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints saved at ring N=2 after STEPS steps (see the worker's CONFIGS)."""
    root = str(tmp_path_factory.mktemp("fully_sharded"))
    (r,) = run_ranks(2, "ckpt_fully_sharded.py", ["save", root, *SAVED])
    return root, r


@pytest.fixture(scope="module")
def resumed_n3(saved):
    """Each N=2 checkpoint loaded at MPI N=3 into a fully sharded model; adamw and
    master saved again there (adamw3, master3)."""
    (r,) = run_ranks(3, "ckpt_fully_sharded.py", [
        "resume", saved[0], "adamw:adamw:adamw3", "muon:muon", "plain:adamw", "ddp:adamw",
        "master:master:master3"])
    return r


def _resumed_ok(r, saved_world):
    assert r["saved_world"] == saved_world and r["step"] == STEPS, r
    assert r["loaded_weights"] <= F32_TOL and r["loaded_state"] <= F32_TOL, r
    assert r["final"] <= F32_TOL, r
    assert r["lr"] == pytest.approx(r["ref_lr"], rel=1e-6), r


@pytest.mark.parametrize("case", ["adamw:adamw:adamw3", "muon:muon"])
def test_fully_sharded_n2_resumes_fully_sharded_at_n3(resumed_n3, case):
    # muon: Muon's matrices are whole on owner ranks (fully_shard(placement=optimizer)),
    # owned by other ranks at N=3; the rest of that model is not wrapped.
    _resumed_ok(resumed_n3[case], 2)


@pytest.mark.parametrize("case", ["plain:adamw", "ddp:adamw"])
def test_checkpoints_without_fully_shard_load_into_a_fully_sharded_model(resumed_n3, case):
    _resumed_ok(resumed_n3[case], 2)


def test_fully_sharded_n3_resumes_at_n2_wrapped_otherwise_or_not(resumed_n3, saved):
    (r,) = run_ranks(2, "ckpt_fully_sharded.py", ["resume", saved[0], "adamw3:root",
                                                  "adamw3:plain", "adamw3:ddp"])
    for case in ("adamw3:root", "adamw3:plain", "adamw3:ddp"):
        _resumed_ok(r[case], 3)


def test_fully_sharded_checkpoints_resume_in_one_process_unsharded(resumed_n3, saved):
    # At N=1 fully_shard leaves the model as it is: plain paths, whole arrays.
    group = mx.distributed.init()
    r = resume(saved[0], ["adamw:single", "muon:single_muon", "adamw3:adamw"], group)
    _resumed_ok(r["adamw:single"], 2)
    _resumed_ok(r["muon:single_muon"], 2)
    _resumed_ok(r["adamw3:adamw"], 3)


def _rows(shape, n, rank):
    """The documented row split, computed independently: [lo, hi) of rank's rows."""
    rows = shape[0] if shape else 1
    k = -(-rows // n)
    return min(rank * k, rows), min(rank * k + k, rows)


def _data_bytes(file):
    """Bytes of array data in a safetensors file (its size less the header)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return os.path.getsize(file) - 8 - n


def test_each_rank_writes_only_its_rows(saved):
    path = os.path.join(saved[0], "adamw")
    ref = dict(tree_flatten(reference("adamw", STEPS)[0].parameters()))
    # Every floating parameter of this model is in a fully sharded module: rank 0's
    # model file is empty, and no rank wrote the whole model.
    assert mx.load(os.path.join(path, "model.safetensors")) == {}
    total = sum(a.nbytes for a in ref.values())
    for rank in range(2):
        file = os.path.join(path, f"model-0000{rank}-of-00002.safetensors")
        held = mx.load(file)
        expected = {}
        for key, whole in ref.items():
            lo, hi = _rows(whole.shape, 2, rank)
            if hi > lo:
                expected[key] = (whole[lo:hi] if whole.ndim else whole).reshape(-1)
        assert sorted(held) == sorted(expected), (rank, sorted(held))
        for key, want in expected.items():
            assert held[key].shape == want.shape, (rank, key, held[key].shape, want.shape)
            assert mx.abs(held[key] - want).max().item() <= F32_TOL, (rank, key)
        assert _data_bytes(file) == sum(a.nbytes for a in expected.values()) < 0.6 * total
    with open(os.path.join(path, "manifest.json")) as f:
        m = json.load(f)
    assert m["format_version"] == 4 and m["model"]["shards"]["scale"]["ranks"] == [0]
    # Plain paths (no "module" keys) and whole shapes everywhere.
    assert m["model"]["parameters"]["inp.weight"]["shape"] == [7, 15]
    assert {s["path"] for b in m["plan"]["buckets"] for s in b["slots"]} == set(ref)
    assert set(m["optimizers"][0]["parameters"]) == set(ref)


def test_owner_placed_matrices_are_written_whole_by_their_owner(saved):
    path = os.path.join(saved[0], "muon")
    ref = dict(tree_flatten(reference("muon", STEPS)[0].parameters()))
    files = [mx.load(os.path.join(path, f"model-0000{r}-of-00002.safetensors")) for r in range(2)]
    # Outside the wrapped layers, parameters are whole in rank 0's model file.
    plain = mx.load(os.path.join(path, "model.safetensors"))
    assert sorted(plain) == ["mix", "proj", "scale", "table.bias", "table.weight"]
    for key in ("inp.weight", "wide.weight", "out.weight"):
        holders = [r for r in range(2) if key in files[r]]
        assert len(holders) == 1, (key, holders)
        assert mx.abs(files[holders[0]][key] - ref[key]).max().item() <= F32_TOL
    for key in ("inp.bias", "wide.bias", "out.bias"):
        assert [files[r][key].size for r in range(2)] == [
            hi - lo for lo, hi in (_rows(ref[key].shape, 2, r) for r in range(2))]


def test_consolidate_gives_the_whole_weights_and_state(saved, tmp_path):
    out = mlx_fsdp.consolidate_checkpoint(os.path.join(saved[0], "adamw"), str(tmp_path / "full"))
    arrays = mx.load(out)
    ref_model, ref_opt = reference("adamw", STEPS)
    for key, want in tree_flatten(ref_model.parameters()):
        assert arrays[f"model.{key}"].shape == want.shape, key
        assert mx.abs(arrays[f"model.{key}"] - want).max().item() <= F32_TOL, key
    for key, want in tree_flatten(ref_opt.state):
        assert mx.abs(arrays[f"optimizer.{key}"] - want).max().item() <= F32_TOL, key
    expected = tree_flatten(ref_model.parameters()) + tree_flatten(ref_opt.state)
    assert len(arrays) == len(expected)


def test_master_weights_reshard_exactly(resumed_n3, saved, tmp_path):
    # Loaded at N=3, every rank holds the masters of exactly what it holds; saved
    # again there, the checkpoint holds the same arrays, bit for bit.
    assert resumed_n3["master:master:master3"]["masters_held"] == 3
    a, b = (mx.load(mlx_fsdp.consolidate_checkpoint(os.path.join(saved[0], name),
                                                    str(tmp_path / name)))
            for name in ("master", "master3"))
    assert sorted(a) == sorted(b) and any(k.startswith("master.") for k in a)
    for key in a:
        assert mx.array_equal(a[key], b[key]).item(), key


def test_a_fully_sharded_model_needs_its_fsdp_step(saved):
    refused = saved[1]["refused"]
    assert len(refused) == 2 and all(r.startswith("ValueError: The model is fully sharded")
                                     and "fsdp_step" in r for r in refused), refused


def _altered(path):
    with open(os.path.join(path, "model-00001-of-00002.safetensors"), "rb+") as f:
        f.seek(-3, 2)
        f.write(b"zzz")


def _edited(edit):
    def apply(path):
        with open(os.path.join(path, "manifest.json")) as f:
            m = json.load(f)
        edit(m)
        with open(os.path.join(path, "manifest.json"), "w") as f:
            json.dump(m, f)
    return apply


@pytest.mark.parametrize("damage, match", [
    (_altered, "model-00001-of-00002.safetensors in .* does not match its sha256"),
    (_edited(lambda m: m["files"].pop("model-00001-of-00002.safetensors")),
     r"manifest field files lacks model-00001-of-00002.safetensors"),
    (_edited(lambda m: m["model"]["shards"]["mix"].update(kind="flat")),
     r"manifest field model.shards\['mix'\].kind is 'flat'"),
    (_edited(lambda m: m["model"]["shards"]["mix"].update(ranks=[0])),
     r"The pieces of 'mix' in model-00000-of-00002.safetensors hold 60 elements, but the "
     "manifest says 105"),
], ids=["altered", "unlisted", "flat", "ranks"])
def test_damaged_model_shards_are_named_and_nothing_changes(saved, tmp_path, damage, match):
    path = str(tmp_path / "ck")
    shutil.copytree(os.path.join(saved[0], "adamw"), path)
    damage(path)
    model, opt = build("single")
    before = [(k, mx.array(v)) for k, v in tree_flatten(model.parameters())]
    with pytest.raises(mlx_fsdp.CheckpointError, match=match):
        mlx_fsdp.load_checkpoint(path, model, opt)
    assert all(mx.array_equal(a, b).item()
               for (_, a), (_, b) in zip(before, tree_flatten(model.parameters())))
