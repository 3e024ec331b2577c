"""The shard files' contents against a checked manifest, before an array is read.

:func:`check_contents` compares the headers of the files (their keys, shapes
and dtypes) with what a :func:`~mlx_fsdp.checkpoint.schema.validate`-d
manifest lists, so that a file that lacks an array or holds it in another
shape raises a :class:`~mlx_fsdp.checkpoint.manifest.CheckpointError` naming
the file and the key, not a reshape error deep inside the load. The model
shard files (format 4) are checked like the optimizer entries.
"""

import math
from typing import Dict, List

from .manifest import (CheckpointError, master_key, model_shard_file, scalar_key, shard_file,
                       state_key)


def stored_weights(manifest: dict) -> List[str]:
    """The model parameters the checkpoint stores (all, or the trainable ones), in the
    model file or (format 4) the model shard files."""
    model = manifest["model"]
    if model.get("weights", "all") == "trainable":
        return list(model["stored"])
    return list(model["parameters"])


def check_contents(manifest: dict, headers: Dict[str, dict]) -> None:
    """Check that every array the manifest lists is in its file, with its shape and dtype.

    Args:
        manifest (dict): A :func:`~mlx_fsdp.checkpoint.schema.validate`-d manifest.
        headers (dict): ``{file name: {key: {"dtype", "shape"}}}`` of every file.

    Raises:
        CheckpointError: Naming the file, the key and what differs.
    """
    def expect(name: str, key: str, shape, dtype: str):
        info = headers[name].get(key)
        if info is None:
            raise CheckpointError(
                f"{name} lacks '{key}', which the manifest lists; the checkpoint is inconsistent.")
        if list(info["shape"]) != list(shape) or info["dtype"] != dtype:
            raise CheckpointError(
                f"{name} holds '{key}' as {tuple(info['shape'])} {info['dtype']}, but the "
                f"manifest says {tuple(shape)} {dtype}; the checkpoint is inconsistent.")

    model = manifest["model"]
    in_shards = model.get("shards", {})
    in_file = [p for p in stored_weights(manifest) if p not in in_shards]
    extra = sorted(set(headers[model["file"]]) - set(in_file))
    if extra:
        raise CheckpointError(f"{model['file']} holds '{extra[0]}', which the manifest does not "
                              "list; the checkpoint is inconsistent.")
    for path in in_file:
        info = model["parameters"][path]
        expect(model["file"], path, info["shape"], info["dtype"])
    num_shards = manifest["plan"]["world_size"]
    shards = [shard_file(r, num_shards) for r in range(num_shards)]

    def entry(key: str, e: dict, size: int, cols: int = 0, files=shards):
        if e["kind"] == "whole":
            expect(files[e["source"]], key, e["shape"], e["dtype"])
        elif e["kind"] == "flat":
            for name in files:
                expect(name, key, [cols], e["dtype"])
        else:
            held = 0
            for r in e["ranks"]:
                shape = headers[files[r]].get(key, {}).get("shape", [0])
                if len(shape) != 1:
                    raise CheckpointError(
                        f"{files[r]} holds '{key}' as {tuple(shape)}, but a piece is 1-D; the "
                        "checkpoint is inconsistent.")
                expect(files[r], key, shape, e["dtype"])
                held += shape[0]
            if held != size:
                raise CheckpointError(
                    f"The pieces of '{key}' in {', '.join(files[r] for r in e['ranks'])} hold "
                    f"{held} elements, but the manifest says {size}; the checkpoint is "
                    "inconsistent.")

    model_files = [model_shard_file(r, num_shards) for r in range(num_shards)]
    for path, e in in_shards.items():
        entry(path, e, math.prod(e["shape"]), files=model_files)

    params = {}
    for k, section in enumerate(manifest["optimizers"]):
        for name, info in section["scalars"].items():
            key = scalar_key(k, name)
            shape = headers[shards[0]].get(key, {}).get("shape", [])
            expect(shards[0], key, shape, info["dtype"])
        for path, p in section["parameters"].items():
            params[path] = p
            for name, e in p["entries"].items():
                entry(state_key(k, path, name), e, p["size"], p.get("cols", 0))
    for path, e in manifest.get("master", {}).items():
        entry(master_key(path), e, params[path]["size"], params[path].get("cols", 0))
