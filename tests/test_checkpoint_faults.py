"""Checkpoint faults (issue 12): a clear error on every rank, and nothing changes.

On real ranks (ring N=2, MPI N=3, each launch under the suite's hard
timeout), every case of ``workers/ckpt_faults.py`` must raise on every rank
and leave the model, the optimizer and the checkpoints on disk as they were.
In one process: a table of edited manifests, each of which must give a
:class:`CheckpointError` naming the field (never a raw ``KeyError``, a reshape
error, or a silent load), files confined to the checkpoint directory, and
saving through a symbolic link.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

import mlx_fsdp
from launch import ROOT, run_ranks
from workers.ckpt_common import make_optimizer, train
from workers.common import make_model

# --- on real ranks ---

ALL, ONE, OTHERS = "all", 1, "others"
NOTHING = r"Nothing was loaded from \S+ on any rank\. The ranks disagree in load_checkpoint: "


def _differ(operation, field, here, there):
    """The RankMismatch of a field that differs on rank 1 from the other ranks."""
    return ("RankMismatch", rf"disagree in {operation}: (.*; )?{field}: ranks? 0(, 2)? {here}, "
                            rf"rank 1 {there}[.;]")


EXPECTED = {
    # Each rank cuts the pieces it holds: it fails on its own first factored
    # entry, or, holding none, hears of the others' failure.
    "owner_into_flat": {ALL: [("CheckpointError", r"The entry 'exp_avg_sq_(row|col)' of '\S+' has "
                               r"shape \(\d+,\), not the parameter's \(\d+, \d+\), so it cannot "
                               r"be cut into flat pieces"),
                              ("RankMismatch", NOTHING + r"status: .*CheckpointError: The entry")]},
    "communication_size": {ALL: ("RankMismatch", NOTHING + r"layout: .*\(communication_size=300\)"
                                 r".*, rank 1 .*\(communication_size=0\)")},
    "model_on_one_rank": {ONE: ("CheckpointError", r"saved from a different model .*proj: "
                                r"\(15, 3\) float32 saved, \(15, 4\) float32 here"),
                          OTHERS: ("RankMismatch", NOTHING + r"status: ranks? 0(, 2)? ok, rank 1 "
                                   r"CheckpointError: The checkpoint")},
    "damaged_on_one_rank": {ONE: ("CheckpointError", r"model.safetensors in \S+ does not match "
                                  r"its sha256"),
                            OTHERS: ("RankMismatch", NOTHING + r"status: ranks? 0(, 2)? ok, rank 1 "
                                     r"CheckpointError: model.safetensors")},
    "load_paths_differ": {ALL: _differ("load_checkpoint", "path", r"\S+/good", r"\S+/copy")},
    "save_paths_differ": {ALL: _differ("save_checkpoint", "path", r"\S+/new0", r"\S+/new1")},
    "save_steps_differ": {ALL: _differ("save_checkpoint", "step", "1", "0")},
    "save_optimizers_differ": {ALL: _differ("save_checkpoint", "optimizer", "AdamW", "SGD")},
    "empty_scalars": {ALL: ("CheckpointError", r"manifest field optimizers\[0\]\.scalars has no "
                            r"'step'")},
    "save_mid_accumulation": {ALL: ("ValueError", r"save_checkpoint was called after 1 of 2 "
                                    r"micro-batches \(opt\.micro_step != 0\)")},
    "load_mid_accumulation": {ALL: ("ValueError", r"load_checkpoint was called after 1 of 2 "
                                    r"micro-batches")},
}


def _launch_cases(n, root):
    """The result lines of every rank (each rank writes its own file)."""
    code, out = run_ranks(n, "ckpt_faults.py", ["cases", root], timeout=180, expect_failure=True)
    assert code == 0, out[-6000:]
    lines = []
    for rank in range(n):
        with open(os.path.join(root, f"results-{rank}.txt")) as f:
            lines += f.read().splitlines()
    return "\n".join(lines)


@pytest.fixture(scope="module")
def ring_faults(tmp_path_factory):
    """The ring N=2 launch of every case; its checkpoints serve the tests in one process."""
    root = str(tmp_path_factory.mktemp("faults_ring"))
    return _launch_cases(2, root), root


@pytest.mark.parametrize("n", [2, 3], ids=["ring-2", "mpi-3"])
def test_every_fault_raises_on_every_rank_and_changes_nothing(ring_faults, tmp_path, n):
    out = ring_faults[0] if n == 2 else _launch_cases(3, str(tmp_path))
    for name, expected in EXPECTED.items():
        for rank in range(n):
            key = ALL if ALL in expected else (ONE if rank == 1 else OTHERS)
            allowed = expected[key] if isinstance(expected[key], list) else [expected[key]]
            lines = [ln for ln in out.splitlines() if ln.startswith(f"CASE {name} rank {rank}: ")]
            error = next((ln for ln in lines if "unchanged=" not in ln), None)
            assert error is not None, f"{name} rank {rank}: no result\n{out[-4000:]}"
            assert any(error.startswith(f"CASE {name} rank {rank}: {kind}: ")
                       and re.search(pattern, error) for kind, pattern in allowed), (name, rank, error)
            assert f"CASE {name} rank {rank}: unchanged=True" in lines, (name, rank, lines)
    for rank in range(n):
        assert f"CASE symlink rank {rank}: link=True target=True" in out, out[-3000:]
        assert f"CASE final rank {rank}: loaded=True" in out, out[-3000:]
        assert f"CASE trainable rank {rank}: stored=out.bias,out.weight equal=True" in out, out
        assert f"CASE reduce_dtype rank {rank}: continues=True" in out, out


@pytest.mark.parametrize("op", ["save", "load"])
def test_call_on_some_ranks_only_ring(tmp_path, op):
    # Rank 1 skips the call and exits: rank 0 must say so, not hang.
    code, out = run_ranks(2, "ckpt_faults.py", ["skip_exit", tmp_path, op], timeout=90,
                          expect_failure=True)
    call = f"{op}_checkpoint"
    assert re.search(rf"rank 0: (PeerLost|RankMismatch): .*{call}.*(every rank|Every rank)", out), out
    assert "NO ERROR" not in out


def test_call_on_some_ranks_only_mpi(tmp_path):
    # MPI does not tell the ranks in save_checkpoint that a peer left; the
    # leaving rank meets them before MPI_Finalize (mlx_fsdp/ending.py), so
    # every rank ends at once with the same error, and mpirun by itself.
    code, out = run_ranks(3, "ckpt_faults.py", ["skip_exit", tmp_path, "save"], timeout=90,
                          expect_failure=True)
    assert code != 0 and "NO ERROR" not in out and "test harness killed" not in out, out
    for rank in range(3):
        assert (f"rank {rank}: RankMismatch: The ranks are at different synchronization points: "
                "ranks 0, 2 in save_checkpoint; rank 1 in exit. The script of rank 1 ended") in out


@pytest.mark.parametrize("n, op", [(2, "save"), (3, "save"), (2, "load")],
                         ids=["ring-2-save", "mpi-3-save", "ring-2-load"])
def test_update_on_one_rank_while_the_others_save_or_load(tmp_path, n, op):
    code, out = run_ranks(n, "ckpt_faults.py", ["skip_update", tmp_path, op], timeout=90,
                          expect_failure=True)
    for rank in range(n):
        assert re.search(rf"rank {rank}: RankMismatch: The ranks are at different synchronization "
                         rf"points: rank 1 in update; ranks? 0(, 2)? in {op}_checkpoint\.", out), out
    assert not os.path.exists(tmp_path / "ck")


# --- one process: the manifest is checked field by field ---

DELETE = object()
MIX = ("optimizers", 0, "parameters", "mix")
M = MIX + ("entries", "m")
SLOT = ("plan", "buckets", 0, "slots", 0)
MODEL = "model.safetensors"
SHARD1 = "optimizer-00001-of-00002.safetensors"


def _set(keys, value):
    def edit(m):
        node = m
        for k in keys[:-1]:
            node = node[k]
        if value is DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return edit


def _field(where):
    return r"manifest field " + re.escape(where) + " "


def _duplicate_index(m):
    b = m["plan"]["buckets"]
    b[1]["slots"][0]["index"] = b[0]["slots"][0]["index"]


def _bad_master(m):
    m["master"] = {"mix": {"kind": "flat", "dtype": "float32", "shape": [3], "source": 0}}


def _trainable(stored):
    def edit(m):
        m["model"]["weights"] = "trainable"
        if stored is not DELETE:
            m["model"]["stored"] = stored
    return edit


MANIFEST_CASES = [
    ("step missing", _set(("step",), DELETE), _field("step") + "is missing"),
    ("step text", _set(("step",), "1"), _field("step") + "must be an integer, not '1'"),
    ("step bool", _set(("step",), True), _field("step") + "must be an integer"),
    ("step negative", _set(("step",), -1), _field("step") + r"is -1, which is not >= 0"),
    ("step inconsistent", _set(("step",), 7),
     _field("step") + r"is 7, but optimizers\[0\]\.scalars\['step'\]\.value is 1"),
    ("world_size zero", _set(("world_size",), 0), _field("world_size") + "is 0"),
    ("layout list", _set(("layout",), []), _field("layout") + "must be a JSON object"),
    ("layout kind", _set(("layout", "kind"), "ring"), _field("layout.kind") + "is 'ring', not one of"),
    ("num_shards missing", _set(("layout", "num_shards"), DELETE),
     _field("layout.num_shards") + "is missing"),
    ("num_shards other", _set(("layout", "num_shards"), 3),
     _field("files['optimizer-00000-of-00002.safetensors']") + "is not a file of this checkpoint"),
    ("num_shards huge", _set(("layout", "num_shards"), 10**15), "is not a file of this checkpoint"),
    ("files list", _set(("files",), []), _field("files") + "must be a JSON object"),
    ("file outside", _set(("files", "../x"), {"sha256": "0" * 64, "bytes": 1}),
     _field("files['../x']") + "is not a file of this checkpoint"),
    ("file absolute", _set(("files", "/etc/hostname"), {"sha256": "0" * 64, "bytes": 1}),
     _field("files['/etc/hostname']") + "is not a file of this checkpoint"),
    ("file shard missing", _set(("files", SHARD1), DELETE), _field("files") + "lacks " + SHARD1),
    ("file model missing", _set(("files", MODEL), DELETE), _field("files") + "lacks " + MODEL),
    ("file info text", _set(("files", MODEL), "abc"), _field(f"files['{MODEL}']") + "must be a JSON"),
    ("bytes text", _set(("files", MODEL, "bytes"), "12"), _field(f"files['{MODEL}'].bytes") + "must be"),
    ("bytes negative", _set(("files", MODEL, "bytes"), -1), _field(f"files['{MODEL}'].bytes") + "is -1"),
    ("bytes missing", _set(("files", MODEL, "bytes"), DELETE), _field(f"files['{MODEL}'].bytes")),
    ("sha256 short", _set(("files", MODEL, "sha256"), "abc"), _field(f"files['{MODEL}'].sha256")),
    ("sha256 number", _set(("files", MODEL, "sha256"), 5), _field(f"files['{MODEL}'].sha256")),
    ("optimizer text", _set(("optimizer",), "AdamW"), _field("optimizer") + "must be a JSON object"),
    ("optimizer class missing", _set(("optimizer", "class"), DELETE), _field("optimizer.class")),
    ("optimizer class number", _set(("optimizer", "class"), 3), _field("optimizer.class")),
    ("sub_optimizers empty", _set(("optimizer", "sub_optimizers"), []),
     _field("optimizer.sub_optimizers") + "is empty"),
    ("scheduled text", _set(("optimizer", "scheduled"), "lr"), _field("optimizer.scheduled")),
    ("optimizers dict", _set(("optimizers",), {}), _field("optimizers") + "must be a JSON list"),
    ("optimizers empty", _set(("optimizers",), []), _field("optimizers") + "has 0 sections"),
    ("scalars empty", _set(("optimizers", 0, "scalars"), {}),
     _field("optimizers[0].scalars") + "has no 'step'"),
    ("scalars list", _set(("optimizers", 0, "scalars"), []), _field("optimizers[0].scalars")),
    ("scalar number", _set(("optimizers", 0, "scalars", "step"), 3),
     _field("optimizers[0].scalars['step']") + "must be a JSON object"),
    ("scalar dtype", _set(("optimizers", 0, "scalars", "step", "dtype"), "float128"),
     _field("optimizers[0].scalars['step'].dtype") + "is 'float128', not one of"),
    ("scalar value text", _set(("optimizers", 0, "scalars", "learning_rate", "value"), "x"),
     _field("optimizers[0].scalars['learning_rate'].value") + "must be a number"),
    ("parameter missing", _set(MIX, DELETE), _field("optimizers[0].parameters['mix']") + "is missing"),
    ("parameter extra", _set(("optimizers", 0, "parameters", "nope"), {}),
     _field("optimizers[0].parameters['nope']") + "is not a parameter of sub-optimizer 0"),
    ("parameter shape", _set(MIX + ("shape",), [15, 7]),
     _field("optimizers[0].parameters['mix'].shape") + r"is \[15, 7\], but the plan slot's shape"),
    ("parameter cols", _set(MIX + ("cols",), 1), _field("optimizers[0].parameters['mix'].cols")),
    ("parameter size text", _set(MIX + ("size",), "105"),
     _field("optimizers[0].parameters['mix'].size") + "must be an integer"),
    ("parameter owner", _set(MIX + ("owner",), 0), _field("optimizers[0].parameters['mix'].owner")),
    ("parameter dtype", _set(MIX + ("dtype",), "float16"),
     _field("optimizers[0].parameters['mix'].dtype") + "is 'float16', but the plan bucket's"),
    ("entries list", _set(MIX + ("entries",), []), _field("optimizers[0].parameters['mix'].entries")),
    ("entry name", _set(MIX + ("entries", "a.b"), {}),
     _field("optimizers[0].parameters['mix'].entries['a.b']") + "is not a state entry name"),
    ("entry null", _set(M, None), _field("optimizers[0].parameters['mix'].entries['m']")),
    ("entry kind", _set(M + ("kind",), "sliced"),
     _field("optimizers[0].parameters['mix'].entries['m'].kind") + "is 'sliced'"),
    ("entry shape", _set(M + ("shape",), [105]),
     _field("optimizers[0].parameters['mix'].entries['m'].shape") + r"is \[105\], but the parameter"),
    ("entry shape negative", _set(M + ("shape",), [7, -15]),
     _field("optimizers[0].parameters['mix'].entries['m'].shape[1]") + "is -15"),
    ("entry ranks", _set(M + ("ranks",), [5]),
     _field("optimizers[0].parameters['mix'].entries['m'].ranks[0]") + r"is 5, which is not in \[0, 2\)"),
    ("entry ranks empty", _set(M + ("ranks",), []),
     _field("optimizers[0].parameters['mix'].entries['m'].ranks") + r"is \[\]; it must list"),
    ("entry ranks repeated", _set(M + ("ranks",), [1, 1]),
     _field("optimizers[0].parameters['mix'].entries['m'].ranks") + r"is \[1, 1\]; it must list"),
    ("entry ranks missing", _set(M + ("ranks",), DELETE),
     _field("optimizers[0].parameters['mix'].entries['m'].ranks") + "is missing"),
    ("entry kind flat without cols", _set(M + ("kind",), "flat"),
     _field("optimizers[0].parameters['mix'].entries['m'].source") + "is missing"),
    ("entry order", _set(M + ("order",), "X"),
     _field("optimizers[0].parameters['mix'].entries['m'].order") + "is 'X'"),
    ("entry dtype missing", _set(M + ("dtype",), DELETE),
     _field("optimizers[0].parameters['mix'].entries['m'].dtype") + "is missing"),
    ("plan null", _set(("plan",), None), _field("plan") + "must be a JSON object"),
    ("plan world_size", _set(("plan", "world_size"), 3),
     _field("plan.world_size") + r"is 3, but layout\.num_shards is 2"),
    ("plan buckets empty", _set(("plan", "buckets"), []), _field("plan.buckets") + "holds no parameter"),
    ("plan buckets text", _set(("plan", "buckets"), "x"), _field("plan.buckets") + "must be a JSON list"),
    ("bucket optimizer", _set(("plan", "buckets", 0, "optimizer"), 2),
     _field("plan.buckets[0].optimizer") + r"is 2, which is not in \[0, 1\)"),
    ("bucket dtype", _set(("plan", "buckets", 0, "dtype"), "x"), _field("plan.buckets[0].dtype")),
    ("slot path", _set(SLOT + ("path",), 5), _field("plan.buckets[0].slots[0].path") + "must be"),
    ("slot index repeated", _duplicate_index, _field("plan.buckets[1].slots[0].index") + "repeats"),
    ("slot size", _set(SLOT + ("size",), 3),
     _field("plan.buckets[0].slots[0].size") + "is 3, but the product of its shape is"),
    ("slot owner", _set(SLOT + ("owner",), 9), _field("plan.buckets[0].slots[0].owner") + "is 9"),
    ("slot order", _set(SLOT + ("order",), "Z"), _field("plan.buckets[0].slots[0].order")),
    ("slot shape", _set(SLOT + ("shape",), "7x15"), _field("plan.buckets[0].slots[0].shape")),
    ("master list", _set(("master",), []), _field("master") + "must be a JSON object"),
    ("master unknown", _set(("master", "nope"), {}), _field("master['nope']") + "is not a parameter"),
    ("master shape", _bad_master, _field("master['mix'].shape") + r"is \[3\], but the parameter"),
    ("model empty", _set(("model",), {}), _field("model.file") + "is missing"),
    ("model file", _set(("model", "file"), "../model.safetensors"),
     _field("model.file") + r"is '\.\./model\.safetensors', but the model file's name"),
    ("model parameters empty", _set(("model", "parameters"), {}), _field("model.parameters") + "is empty"),
    ("model parameter shape", _set(("model", "parameters", "mix", "shape"), [1]),
     _field("model.parameters['mix'].shape") + r"is \[1\], but the plan slot's shape"),
    ("model parameter dtype", _set(("model", "parameters", "mix", "dtype"), "float8"),
     _field("model.parameters['mix'].dtype") + "is 'float8', not one of"),
    ("model weights", _set(("model", "weights"), "some"), _field("model.weights") + "is 'some'"),
    ("stored missing", _trainable(DELETE), _field("model.stored") + "is missing"),
    ("stored unknown", _trainable(["nope"]), _field("model.stored[0]") + "is 'nope', not a path"),
    ("stored lacks trained", _trainable(["mix"]), _field("model.stored") + "lacks"),
    ("format_version text", _set(("format_version",), "2"), r"format_version='2'; this mlx_fsdp reads"),
    ("format_version bool", _set(("format_version",), True), r"format_version=True; this mlx_fsdp reads"),
    ("format missing", _set(("format",), DELETE), "is not an mlx_fsdp checkpoint manifest"),
]


@pytest.fixture(scope="module")
def good(ring_faults):
    """AdamW saved at N=2 with small buckets (flat entries over two shards)."""
    return os.path.join(ring_faults[1], "good")


@pytest.fixture(scope="module")
def owned(ring_faults):
    """Adafactor saved at N=2: factored state kept whole on owner ranks."""
    return os.path.join(ring_faults[1], "owned")


def _copy(src, tmp_path, edit=None):
    path = str(tmp_path / "ck")
    shutil.copytree(src, path, symlinks=True)
    if edit is not None:
        file = os.path.join(path, "manifest.json")
        with open(file) as f:
            m = json.load(f)
        edit(m)
        with open(file, "w") as f:
            json.dump(m, f)
    return path


def _target(make=lambda: optim.AdamW(learning_rate=1e-2, weight_decay=0.05)):
    """A trained model and optimizer, with snapshots to compare after a failed load."""
    model, opt = make_model(seed=9, bf16=False), mlx_fsdp.fsdp_step(make())
    train(model, opt, 1)
    snap = [(k, mx.array(v)) for k, v in tree_flatten(model.parameters()) + tree_flatten(opt.state)]
    return model, opt, snap


def _unchanged(model, opt, snap):
    now = tree_flatten(model.parameters()) + tree_flatten(opt.state)
    return [k for k, _ in now] == [k for k, _ in snap] and all(
        mx.array_equal(a, b, equal_nan=True).item() for (_, a), (_, b) in zip(now, snap))


def _files(path):
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _refused(path, match, make=None):
    model, opt, snap = _target(make) if make else _target()
    disk = _files(path)
    with pytest.raises(mlx_fsdp.CheckpointError, match=match):
        mlx_fsdp.load_checkpoint(path, model, opt)
    assert _unchanged(model, opt, snap)
    assert _files(path) == disk


@pytest.mark.parametrize("edit, match", [c[1:] for c in MANIFEST_CASES],
                         ids=[c[0] for c in MANIFEST_CASES])
def test_every_malformed_manifest_field_is_named(good, tmp_path, edit, match):
    _refused(_copy(good, tmp_path, edit), match)


def test_the_unedited_copy_loads(good, tmp_path):
    model, opt, _ = _target()
    assert mlx_fsdp.load_checkpoint(_copy(good, tmp_path), model, opt)["step"] == 1


def _entries(m, path):
    return m["optimizers"][0]["parameters"][path]


def _owner_flat(m):
    _entries(m, "inp.bias")["entries"]["exp_avg_sq"]["kind"] = "flat"


def _owner_source(m):
    e = _entries(m, "inp.weight")
    e["entries"]["exp_avg_sq_row"]["source"] = 1 - e["owner"]


@pytest.mark.parametrize("edit, match", [
    (_owner_flat, _field("optimizers[0].parameters['inp.bias'].entries['exp_avg_sq'].kind")
     + "is 'flat', but the parameter is kept whole on an owner rank"),
    (_owner_source, _field("optimizers[0].parameters['inp.weight'].entries['exp_avg_sq_row']"
                           ".source") + "is [01], but the parameter's owner is [01]"),
], ids=["flat entry of an owned array", "source is not the owner"])
def test_owner_fields_are_checked(owned, tmp_path, edit, match):
    _refused(_copy(owned, tmp_path, edit), match, make=lambda: optim.Adafactor(learning_rate=1e-2))


@pytest.mark.parametrize("text, match", [
    ("{", "is not valid JSON"),
    ("[1, 2]", "is not an mlx_fsdp checkpoint manifest"),
    ("[" * 100000 + "]" * 100000, "is not valid JSON"),
], ids=["truncated", "a list", "deeply nested"])
def test_a_manifest_that_is_not_one(good, tmp_path, text, match):
    path = _copy(good, tmp_path)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write(text)
    _refused(path, match)


def _rewrite(path, name, arrays):
    """Replace a file and make the manifest's size and checksum agree with it."""
    file = os.path.join(path, name)
    if isinstance(arrays, bytes):
        with open(file, "wb") as f:
            f.write(arrays)
    else:
        mx.save_safetensors(file, arrays)
    with open(os.path.join(path, "manifest.json")) as f:
        m = json.load(f)
    with open(file, "rb") as f:
        data = f.read()
    m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(m, f)


def test_files_that_disagree_with_a_consistent_manifest(good, tmp_path):
    # The checksums match (the manifest was rewritten with the files): the
    # arrays inside are still checked against the manifest before any is read.
    path = _copy(good, tmp_path / "a")
    shard = dict(mx.load(os.path.join(path, SHARD1)))
    shard["state/0/mix/m"] = mx.zeros((3,))
    _rewrite(path, SHARD1, shard)
    _refused(path, re.escape("The pieces of 'state/0/mix/m' in optimizer-00000-of-00002.safetensors, "
                             f"{SHARD1} hold 56 elements, but the manifest says 105"))
    path = _copy(good, tmp_path / "b")
    weights = dict(mx.load(os.path.join(path, MODEL)))
    weights["extra"] = mx.zeros((2,))
    _rewrite(path, MODEL, weights)
    _refused(path, "model.safetensors holds 'extra', which the manifest does not list")
    path = _copy(good, tmp_path / "c")
    _rewrite(path, SHARD1, b"\xff" * 7)
    _refused(path, f"{SHARD1} is not a valid safetensors file")


def test_no_file_outside_the_checkpoint_is_read(good, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 12345)
    path = _copy(good, tmp_path / "x", _set(("files", "../secret"), {"sha256": "0" * 64, "bytes": 1}))
    model, opt, snap = _target()
    with pytest.raises(mlx_fsdp.CheckpointError) as info:
        mlx_fsdp.load_checkpoint(path, model, opt)
    assert "files['../secret']" in str(info.value) and "12345" not in str(info.value)
    # A shard replaced by a link to an identical copy outside: refused, not followed.
    path = _copy(good, tmp_path / "y")
    outside = str(tmp_path / "outside.safetensors")
    shutil.move(os.path.join(path, SHARD1), outside)
    os.symlink(outside, os.path.join(path, SHARD1))
    _refused(path, f"{SHARD1} in \\S+ is a symbolic link that leaves the checkpoint directory")
    # The checkpoint directory itself may be a link (a "latest" link).
    latest = str(tmp_path / "latest")
    os.symlink(_copy(good, tmp_path / "z"), latest)
    assert mlx_fsdp.load_checkpoint(latest, model, opt)["step"] == 1


def test_consolidate_names_the_field(good, tmp_path):
    path = _copy(good, tmp_path, _set(("optimizers", 0, "scalars"), {}))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "mlx_fsdp.checkpoint", "consolidate", path,
                           str(tmp_path / "o")], capture_output=True, text=True, env=env)
    assert proc.returncode == 1
    assert "manifest field optimizers[0].scalars has no 'step'" in proc.stderr, proc.stderr


# --- one process: saving through a symbolic link ---

def _save(path, steps):
    model, opt = make_model(bf16=False), make_optimizer("adamw")
    train(model, opt, steps)
    mlx_fsdp.save_checkpoint(path, model, opt)


def _step_of(path):
    model, opt = make_model(seed=3, bf16=False), make_optimizer("adamw")
    return mlx_fsdp.load_checkpoint(path, model, opt)["step"]


def test_saving_through_a_link_replaces_its_target_and_keeps_the_link(tmp_path):
    real, link = tmp_path / "runs" / "step", tmp_path / "latest"
    os.makedirs(tmp_path / "runs")
    _save(str(real), 1)
    os.symlink(real, link)
    _save(str(link), 2)  # replaces the directory the link points to
    assert os.path.islink(link) and os.readlink(link) == str(real)
    assert _step_of(str(real)) == 2 and _step_of(str(link)) == 2
    assert sorted(os.listdir(tmp_path)) == ["latest", "runs"]
    assert sorted(os.listdir(tmp_path / "runs")) == ["step"]
    _save(str(link), 3)  # and again: every later save works the same way
    assert _step_of(str(link)) == 3 and os.path.islink(link)
    # A link that does not lead anywhere yet: the checkpoint is made where it points.
    dangling = tmp_path / "next"
    os.symlink(tmp_path / "runs" / "later", dangling)
    _save(str(dangling), 1)
    assert _step_of(str(tmp_path / "runs" / "later")) == 1 and os.path.islink(dangling)


def test_a_link_to_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path):
    data = tmp_path / "data"
    os.makedirs(data)
    (data / "keep").write_text("x")
    os.symlink(data, tmp_path / "ck")
    with pytest.raises(ValueError, match=f"{re.escape(str(data))} exists and is not an mlx_fsdp "
                       "checkpoint"):
        _save(str(tmp_path / "ck"), 1)
    assert (data / "keep").read_text() == "x" and os.listdir(data) == ["keep"]
