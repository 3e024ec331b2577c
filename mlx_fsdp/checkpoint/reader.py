"""Reading a checkpoint directory without trusting it.

The manifest is checked against its schema (:mod:`.schema`) before any field
is used, and every file it names must be a plain file name inside the
checkpoint directory: no absolute path, no ``..``, no symbolic link that
leaves the directory. A file outside is never opened, and no error message
tells anything about it (its size, whether it exists). The directory itself may be a link (a
``latest`` link to the newest checkpoint): its real path is the directory the
files must stay in.
"""

import json
import os
from typing import Dict, Tuple

import mlx.core as mx

from . import contents, schema
from .layout import rebuild, rebuild_weights
from .manifest import (
    FORMAT,
    MANIFEST,
    READABLE_VERSIONS,
    CheckpointError,
    read_header,
    sha256_file,
)


def inside(root: str, name: str, field: str) -> str:
    """The path of the file ``name`` in the directory ``root`` (a real path).

    Raises:
        CheckpointError: If ``name`` is not a plain file name, or is a link
            that leaves ``root``.
    """
    if (not isinstance(name, str) or name in ("", ".", "..") or os.path.isabs(name)
            or "/" in name or "\\" in name or "\0" in name or os.sep in name):
        raise CheckpointError(
            f"manifest field {field} is {name!r}, which is not a file name inside the "
            f"checkpoint directory {root}; refusing to read it."
        )
    file = os.path.join(root, name)
    if os.path.islink(file) and os.path.dirname(os.path.realpath(file)) != root:
        raise CheckpointError(
            f"{name} in {root} is a symbolic link that leaves the checkpoint directory; "
            "refusing to read it. Copy the file itself into the directory."
        )
    return file


def _missing(path: str) -> CheckpointError:
    parent, base = os.path.split(path.rstrip(os.sep))
    hints = []
    if os.path.isdir(os.path.join(parent, f".{base}.old")):
        hints.append(
            f" A save was interrupted while replacing it; the previous checkpoint "
            f"is intact at {os.path.join(parent, '.' + base + '.old')}."
        )
    if os.path.isdir(os.path.join(parent, f".{base}.partial")):
        hints.append(" An interrupted save left an incomplete .partial directory next to it.")
    what = "has no manifest.json" if os.path.isdir(path) else "does not exist"
    return CheckpointError(f"The checkpoint {path} {what}; it is not a complete checkpoint."
                           + "".join(hints))


def read_manifest(path: str) -> dict:
    """Read ``path/manifest.json`` and check it against the schema.

    Raises:
        CheckpointError: naming the missing or malformed part, and pointing at
            the leftovers of an interrupted save if there are any.
    """
    path = os.path.abspath(path)
    file = inside(os.path.realpath(path), MANIFEST, "(the manifest itself)")
    if not os.path.isfile(file):
        raise _missing(path)
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}); the checkpoint is damaged.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not an mlx_fsdp checkpoint manifest (no format={FORMAT!r}).")
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise CheckpointError(
            f"{file} has format_version={version!r}; this mlx_fsdp reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}. Use the mlx_fsdp version that wrote it "
            f"({str(manifest.get('mlx_fsdp_version'))[:40]})."
        )
    return schema.validate(manifest, file)


def verify_files(path: str, manifest: dict):
    """Check that every file the manifest lists exists with its size and sha256.

    Args:
        path (str): The checkpoint directory.
        manifest (dict): Its manifest, from :func:`read_manifest`.

    Raises:
        CheckpointError: naming the first missing, truncated or altered file.
    """
    path = os.path.abspath(path)
    root = os.path.realpath(path)
    for name, info in sorted(manifest["files"].items()):
        file = inside(root, name, f"files[{name!r}]")
        if not os.path.isfile(file):
            raise CheckpointError(
                f"The checkpoint {path} is missing {name} (listed in its manifest); "
                "copy the whole directory, every shard file included."
            )
        size = os.path.getsize(file)
        if size != info["bytes"]:
            raise CheckpointError(
                f"{name} in {path} has {size} bytes but the manifest says "
                f"{info['bytes']}: the file is truncated or altered."
            )
        if sha256_file(file) != info["sha256"]:
            raise CheckpointError(
                f"{name} in {path} does not match its sha256 in the manifest: the "
                "file is altered or corrupted."
            )


def open_checkpoint(path: str) -> Tuple[dict, Dict[str, dict]]:
    """The checked manifest and every file's arrays (not yet evaluated).

    Checks, in order: the manifest's schema, each file's place, size and
    sha256, and each file's header against the manifest (every listed array
    present with its shape and dtype).

    Returns:
        tuple: ``(manifest, {file name: {key: array}})``.

    Raises:
        CheckpointError: naming the first problem.
    """
    manifest = read_manifest(path)
    verify_files(path, manifest)
    root = os.path.realpath(path)
    files = {name: inside(root, name, f"files[{name!r}]") for name in manifest["files"]}
    contents.check_contents(manifest, {name: read_header(file) for name, file in files.items()})
    arrays = {}
    for name, file in files.items():
        try:
            arrays[name] = mx.load(file)
        except (RuntimeError, ValueError, OSError) as e:
            raise CheckpointError(f"{name} in {path} cannot be read ({e}); the checkpoint is "
                                  "damaged.") from None
    return manifest, arrays


def read_checkpoint(path: str):
    """A checked checkpoint's manifest and whole arrays (not yet evaluated).

    Returns:
        tuple: ``(manifest, model weights {plain path: whole array}, states,
        scalars, master)``, the last three as :func:`.layout.rebuild` returns them.

    Raises:
        CheckpointError: Naming the first problem with the manifest or the files.
    """
    manifest, files = open_checkpoint(path)
    try:
        states, scalars, master = rebuild(manifest, files)
        weights = rebuild_weights(manifest, files)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise CheckpointError(
            f"The checkpoint {path} does not match its manifest; rebuilding the optimizer "
            f"state or the model failed ({type(e).__name__}: {e})."
        ) from None
    return manifest, weights, states, scalars, master
