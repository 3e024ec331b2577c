"""The on-disk format of a checkpoint: file names, array keys, the manifest, checks.

A checkpoint is a directory::

    manifest.json                              what is where, in plain JSON
    model.safetensors                          the model's parameters (rank 0)
    optimizer-00000-of-00002.safetensors       shard 0 of the optimizer state
    optimizer-00001-of-00002.safetensors       shard 1 ...
    model-00000-of-00002.safetensors           shard 0 of a fully sharded model's
    model-00001-of-00002.safetensors           parameters (format 4) ...

Parameters are named by their plain paths, those of the model without
:func:`mlx_fsdp.fully_shard` (no ``"module"`` keys), so that a checkpoint
loads into the model wrapped in any way, or not at all.

Keys inside the optimizer files (``k`` is the sub-optimizer index, 0 unless
the optimizer is a ``MultiOptimizer``):

* ``state/{k}/{path}/{name}``: what this shard holds of the entry ``name``
  (e.g. ``m``) of the state of the parameter at ``path``: its 1-D piece of a
  flat bucket (see :mod:`mlx_fsdp.layout`), or the whole entry (owned
  arrays, plain layouts);
* ``scalars/{k}/{name}``: sub-optimizer ``k``'s top-level state (``step``,
  ``learning_rate``);
* ``master/{path}``: the fp32 master copy of the parameter, laid out like
  the optimizer entries.

Keys inside the model files are the parameters' paths: in ``model.safetensors``
whole arrays, in a model shard file what that rank holds, laid out like the
optimizer entries (the manifest's ``model.shards``).

Everything here is plain Python and JSON so that the format can be read,
checked and explained without the rest of the package.
"""

import hashlib
import json
import os
import struct

import mlx.optimizers as optim

FORMAT = "mlx_fsdp-checkpoint"
#: Version 3 stores what each rank holds of an array in a flat bucket (entries
#: of kind "pieces": no per-array padding). Version 2 split every array over
#: every rank, zero-padded, and added each flat entry's element ``order``;
#: version 1 had row order throughout. Version 3 also adds ``model.weights``
#: (``"trainable"``: a model file with only the trained parameters). Version 4
#: adds ``model.shards``: parameters of a fully sharded model stored as what
#: each rank holds, in the model shard files. A checkpoint is written in the
#: oldest version that describes it (4 only with model shards), so that
#: older readers read what they can; they refuse newer versions.
FORMAT_VERSION = 4
VERSION_WITHOUT_MODEL_SHARDS = 3
READABLE_VERSIONS = (1, 2, 3, 4)
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"

# How a reader rebuilds each entry, written into every manifest so that the
# format explains itself.
LAYOUT_NOTE = (
    "For each parameter listed under optimizers[k].parameters[path] and each entry name "
    "under its entries: kind 'pieces' means the entry is split over the shard files of "
    "the ranks listed in `ranks`: concatenate key 'state/{k}/{path}/{name}' of those "
    "files in that order (`size` elements) and reshape to `shape`, except that order 'F' "
    "lists the elements column by column: reshape to the reversed shape and transpose. "
    "Kind 'whole' means the entry is stored whole, with its own shape, under that key "
    "in the file of shard `source`. Top-level optimizer state is 'scalars/{k}/{name}' "
    "in shard file 0; fp32 master weights (if listed under 'master') are "
    "'master/{path}', laid out like the entries. Model weights are in "
    "model.safetensors, keyed by path, except those listed under model.shards: laid out "
    "like the entries, under key '{path}' of the files model-RRRRR-of-NNNNN.safetensors. "
    "Paths are plain: without the 'module' keys that mlx_fsdp.fully_shard adds."
)


class CheckpointError(ValueError):
    """A checkpoint cannot be read or does not fit the model and optimizer."""


def shard_file(rank: int, num_shards: int) -> str:
    """The file name of shard ``rank`` of ``num_shards``."""
    return f"optimizer-{rank:05d}-of-{num_shards:05d}.safetensors"


def model_shard_file(rank: int, num_shards: int) -> str:
    """The file name of what rank ``rank`` of ``num_shards`` holds of a fully sharded model."""
    return f"model-{rank:05d}-of-{num_shards:05d}.safetensors"


def state_key(k: int, path: str, name: str) -> str:
    return f"state/{k}/{path}/{name}"


def scalar_key(k: int, name: str) -> str:
    return f"scalars/{k}/{name}"


def master_key(path: str) -> str:
    return f"master/{path}"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# safetensors dtype codes -> MLX dtype names.
SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
}


def read_header(path: str) -> dict:
    """``{key: {"dtype": mlx dtype name, "shape": [...]}}`` of a safetensors file.

    Reads only the JSON header (8-byte little-endian length, then JSON), not
    the arrays.

    Raises:
        CheckpointError: If the file is not a well-formed safetensors file.
    """
    name = os.path.basename(path)

    def bad(why):
        return CheckpointError(f"{name} is not a valid safetensors file ({why}); the "
                               "checkpoint is damaged.")

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise bad("shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise bad(f"its header length {n} exceeds the file")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:
            raise bad(f"its header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    header.pop("__metadata__", None)
    out = {}
    for k, v in header.items():
        if not (isinstance(v, dict) and isinstance(v.get("dtype"), str)
                and isinstance(v.get("shape"), list)
                and all(isinstance(d, int) and d >= 0 for d in v["shape"])):
            raise bad(f"the header entry {k[:80]!r} has no dtype and shape")
        out[k] = {"dtype": SAFETENSORS_DTYPES.get(v["dtype"], v["dtype"]),
                  "shape": list(v["shape"])}
    return out


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v) for v in value)
    return False


def describe_optimizer(optimizer) -> dict:
    """Class, hyper-parameters and scheduled names of an MLX optimizer (JSON-able).

    Hyper-parameters are the public attributes with JSON values (``betas``,
    ``eps``, ``weight_decay``...); the learning rate is in the state, and a
    scheduled one is listed under ``scheduled`` (a schedule is code and cannot
    be saved: the step count is, so a recreated schedule continues).
    """
    out = {"class": type(optimizer).__name__, "module": type(optimizer).__module__}
    if isinstance(optimizer, optim.MultiOptimizer):
        out["sub_optimizers"] = [describe_optimizer(o) for o in optimizer.optimizers]
        return out
    out["hyperparameters"] = {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in sorted(vars(optimizer).items())
        if not k.startswith("_") and _jsonable(v)
    }
    out["scheduled"] = sorted(getattr(optimizer, "_schedulers", {}))
    return out


def class_names(description: dict) -> list:
    """``[outer class, sub-optimizer classes...]`` of a description."""
    return [description["class"]] + [s["class"] for s in description.get("sub_optimizers", [])]


def write_json(path: str, data: dict):
    """Write JSON and flush it to disk before returning."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
