"""The manifest's schema: every field checked before any is used.

A manifest is plain JSON that anyone can edit, copy half of, or write by
hand, so nothing in it is trusted: :func:`validate` checks the type, the range
and the consistency of every field that loading or consolidating reads (the
plan against the per-optimizer description, the model section against the
plan, the file list against the number of shards and the model shards), one
section at a time (the plan and the optimizer description in :mod:`.schema_plan`).
Each problem raises a :class:`~mlx_fsdp.checkpoint.manifest.CheckpointError`
that names the field (:mod:`.fields`), e.g. ``manifest field files['../x']:
...``, instead of a ``KeyError`` or a reshape error deep inside the load. The
shard files' headers are checked against the manifest afterwards
(:mod:`.contents`).
"""

import math
import re
from typing import Dict

from .fields import Fields, show
from .manifest import MODEL_FILE, model_shard_file, shard_file
from .schema_plan import ORDERS, optimizer_section, plan_section

#: "pieces" (formats 3 and 4): the entry split over the files of the ranks
#: that hold it; "flat" (formats 1 and 2): split over every rank, zero-padded;
#: "whole". Model shards (format 4) are "pieces" or "whole".
KINDS = ("pieces", "flat", "whole")
#: What ``save_checkpoint(weights=...)`` stores of the model (``model.weights``).
WEIGHTS = ("all", "trainable")
LAYOUTS = ("sharded", "plain")
_SHARD = re.compile(r"optimizer-(\d{5,})-of-(\d{5,})\.safetensors")
_MODEL_SHARD = re.compile(r"model-(\d{5,})-of-(\d{5,})\.safetensors")


def _key(where: str, key) -> str:
    return f"{where}[{show(key)}]"


def _entry(f: Fields, entry, where: str, param: dict, param_where: str, num_shards: int):
    f.dict(entry, where)
    kind = f.str(f.get(entry, "kind", where), f"{where}.kind", KINDS)
    f.dtype(f.get(entry, "dtype", where), f"{where}.dtype")
    shape = f.shape(f.get(entry, "shape", where), f"{where}.shape")
    f.str(f.get(entry, "order", where, optional=True, default="C"), f"{where}.order", ORDERS)
    if kind == "whole":
        source = f.int(f.get(entry, "source", where), f"{where}.source", 0, num_shards)
        if param.get("owner") is not None:
            f.equal(source, param["owner"], f"{where}.source", "the parameter's owner")
        return
    f.equal(shape, param["shape"], f"{where}.shape", "the parameter's shape")
    if param.get("owner") is not None:
        f.fail(f"{where}.kind", f"is {kind!r}, but the parameter is kept whole on an owner rank")
    if kind == "pieces":
        ranks = f.list(f.get(entry, "ranks", where), f"{where}.ranks")
        for i, r in enumerate(ranks):
            f.int(r, f"{where}.ranks[{i}]", 0, num_shards)
        if not ranks or ranks != sorted(set(ranks)):
            f.fail(f"{where}.ranks", f"is {show(ranks)}; it must list the ranks that hold "
                   "pieces, each once, in increasing order")
        return
    f.int(f.get(entry, "source", where), f"{where}.source", 0, num_shards)
    cols = f.int(f.get(param, "cols", param_where), f"{param_where}.cols")
    if num_shards * cols < param["size"]:
        f.fail(where, f"is flat, but {num_shards} pieces of {cols} elements cannot hold the "
               f"parameter's {param['size']}")


def _parameter(f: Fields, param, where: str, slot: dict, param_dtype: str, num_shards: int):
    f.dict(param, where)
    f.shape(f.get(param, "shape", where), f"{where}.shape")
    f.int(f.get(param, "size", where), f"{where}.size")
    for name in ("shape", "size"):
        f.equal(param[name], slot[name], f"{where}.{name}", f"the plan slot's {name}")
    if "cols" in param:  # formats 1 and 2
        f.equal(param["cols"], slot.get("cols"), f"{where}.cols", "the plan slot's cols")
    f.equal(f.get(param, "owner", where, optional=True), slot.get("owner"), f"{where}.owner",
            "the plan slot's owner")
    f.equal(f.get(param, "dtype", where), param_dtype, f"{where}.dtype", "the plan bucket's param_dtype")
    for name, entry in f.dict(f.get(param, "entries", where), f"{where}.entries").items():
        if not name or "." in name or "/" in name:
            f.fail(_key(f"{where}.entries", name), "is not a state entry name (no '.' or '/')")
        _entry(f, entry, _key(f"{where}.entries", name), param, where, num_shards)


def _optimizers(f: Fields, sections, count: int, slots: Dict[str, tuple], num_shards: int):
    f.list(sections, "optimizers")
    if len(sections) != count:
        f.fail("optimizers", f"has {len(sections)} sections, but the optimizer has {count} "
               "(sub-)optimizers")
    for k, section in enumerate(sections):
        where = f"optimizers[{k}]"
        f.dict(section, where)
        scalars = f.dict(f.get(section, "scalars", where), f"{where}.scalars")
        if "step" not in scalars:
            f.fail(f"{where}.scalars", "has no 'step' (every optimizer state counts its steps)")
        for name, info in scalars.items():
            at = _key(f"{where}.scalars", name)
            f.dict(info, at)
            if not name or "/" in name:
                f.fail(at, "is not a state entry name")
            f.dtype(f.get(info, "dtype", at), f"{at}.dtype")
            value = f.get(info, "value", at, optional=True)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                f.fail(f"{at}.value", f"must be a number, not {show(value)}")
        params = f.dict(f.get(section, "parameters", where), f"{where}.parameters")
        expected = {p for p, (o, _, _) in slots.items() if o == k}
        for path in sorted(set(params) - expected):
            f.fail(_key(f"{where}.parameters", path), f"is not a parameter of sub-optimizer {k} "
                   "in the plan")
        for path in sorted(expected - set(params)):
            f.fail(_key(f"{where}.parameters", path), "is missing (the plan lists it)")
        for path, param in params.items():
            _, slot, dtype = slots[path]
            _parameter(f, param, _key(f"{where}.parameters", path), slot, dtype, num_shards)


def _model(f: Fields, model, slots: Dict[str, tuple], num_shards: int):
    f.dict(model, "model")
    f.equal(f.get(model, "file", "model"), MODEL_FILE, "model.file", "the model file's name")
    params = f.dict(f.get(model, "parameters", "model"), "model.parameters")
    if not params:
        f.fail("model.parameters", "is empty")
    for path, info in params.items():
        where = _key("model.parameters", path)
        if not path:
            f.fail(where, "is not a parameter path")
        f.dict(info, where)
        f.shape(f.get(info, "shape", where), f"{where}.shape")
        f.dtype(f.get(info, "dtype", where), f"{where}.dtype")
    for path, (_, slot, dtype) in slots.items():
        where = _key("model.parameters", path)
        if path not in params:
            f.fail(where, "is missing (the plan trains it)")
        f.equal(params[path]["shape"], slot["shape"], f"{where}.shape", "the plan slot's shape")
        f.equal(params[path]["dtype"], dtype, f"{where}.dtype", "the plan bucket's param_dtype")
    weights = f.str(f.get(model, "weights", "model", optional=True, default="all"),
                    "model.weights", WEIGHTS)
    stored = params
    if weights == "trainable":
        stored = f.list(f.get(model, "stored", "model"), "model.stored")
        for i, path in enumerate(stored):
            if not isinstance(path, str) or path not in params:
                f.fail(f"model.stored[{i}]", f"is {show(path)}, not a path of model.parameters")
        if len(set(stored)) != len(stored):
            f.fail("model.stored", "lists a parameter twice")
        for path in slots:
            if path not in stored:
                f.fail("model.stored", f"lacks {path!r}, which the plan trains")
    shards = f.dict(f.get(model, "shards", "model", optional=True, default={}), "model.shards")
    for path, entry in shards.items():  # format 4: in the model shard files
        where = _key("model.shards", path)
        if path not in stored:
            f.fail(where, "is not a parameter that the checkpoint stores")
        if f.dict(entry, where).get("kind") == "flat":
            f.fail(f"{where}.kind", "is 'flat', which only optimizer entries of formats 1 and 2 "
                   "are")
        info = params[path]
        _entry(f, entry, where, {"shape": info["shape"], "size": math.prod(info["shape"])},
               _key("model.parameters", path), num_shards)
        f.equal(entry["shape"], info["shape"], f"{where}.shape", "the parameter's shape")
        f.equal(entry["dtype"], info["dtype"], f"{where}.dtype", "the parameter's dtype")


def _one_of(name: str, kinds, num_shards: int) -> bool:
    """Whether ``name`` is a shard file of one of ``kinds`` (without listing them all)."""
    for pattern, make in kinds:
        match = pattern.fullmatch(name)
        if match and int(match[1]) < num_shards and name == make(int(match[1]), num_shards):
            return True
    return False


def _files(f: Fields, files, num_shards: int, model_shards: bool):
    f.dict(files, "files")
    kinds = [(_SHARD, shard_file)] + ([(_MODEL_SHARD, model_shard_file)] if model_shards else [])
    listed = ", ".join(
        make(0, num_shards) + (" ... " + make(num_shards - 1, num_shards) if num_shards > 1 else "")
        for _, make in kinds)
    for name, info in files.items():
        where = _key("files", name)
        if name != MODEL_FILE and not _one_of(name, kinds, num_shards):
            f.fail(where, f"is not a file of this checkpoint (its files are {MODEL_FILE}, "
                   f"{listed})")
        f.dict(info, where)
        digest = f.str(f.get(info, "sha256", where), f"{where}.sha256")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            f.fail(f"{where}.sha256", "must be 64 lower-case hexadecimal digits")
        f.int(f.get(info, "bytes", where), f"{where}.bytes")
    if MODEL_FILE not in files:
        f.fail("files", f"lacks {MODEL_FILE}")
    if len(files) != len(kinds) * num_shards + 1:
        # At most len(files) names are present, so this stops early.
        missing = next(n for _, make in kinds for n in (make(r, num_shards)
                                                        for r in range(num_shards))
                       if n not in files)
        f.fail("files", f"lacks {missing} (layout.num_shards is {num_shards})")


def validate(manifest: dict, file: str) -> dict:
    """Check every field of a manifest that loading or consolidating reads.

    Args:
        manifest (dict): The parsed JSON (``format`` and ``format_version``
            already checked).
        file (str): The manifest's path, for messages.

    Returns:
        dict: ``manifest``, unchanged.

    Raises:
        CheckpointError: Naming the first bad field.
    """
    f = Fields(file)
    f.int(f.get(manifest, "step", ""), "step")
    f.int(f.get(manifest, "world_size", ""), "world_size", 1)
    for name in ("mlx_fsdp_version", "mlx_version"):
        f.str(f.get(manifest, name, "", optional=True, default="-"), name)
    wrapper = f.get(manifest, "wrapper", "", optional=True)
    if wrapper is not None:
        f.dict(wrapper, "wrapper")
    layout = f.dict(f.get(manifest, "layout", ""), "layout")
    f.str(f.get(layout, "kind", "layout"), "layout.kind", LAYOUTS)
    num_shards = f.int(f.get(layout, "num_shards", "layout"), "layout.num_shards", 1)
    model = manifest.get("model")
    shards = model.get("shards") if isinstance(model, dict) else None
    _files(f, f.get(manifest, "files", ""), num_shards, isinstance(shards, dict) and bool(shards))
    count = optimizer_section(f, f.get(manifest, "optimizer", ""), "optimizer")
    slots = plan_section(f, f.get(manifest, "plan", ""), count)
    f.equal(manifest["plan"]["world_size"], num_shards, "plan.world_size", "layout.num_shards")
    _optimizers(f, f.get(manifest, "optimizers", ""), count, slots, num_shards)
    first = manifest["optimizers"][0]["scalars"]["step"].get("value")
    if first is not None:
        f.equal(manifest["step"], first, "step", "optimizers[0].scalars['step'].value")
    master = f.dict(f.get(manifest, "master", "", optional=True, default={}), "master")
    for path, entry in master.items():
        if path not in slots:
            f.fail(_key("master", path), "is not a parameter of the plan")
        k = slots[path][0]
        at = _key(f"optimizers[{k}].parameters", path)
        _entry(f, entry, _key("master", path), manifest["optimizers"][k]["parameters"][path],
               at, num_shards)
    _model(f, f.get(manifest, "model", ""), slots, num_shards)
    return manifest

