"""Writing a checkpoint directory so that no reader ever sees half of it.

Every rank writes into ``.NAME.partial`` next to the target. When all ranks
report success (one small all-gather, which is also the barrier), rank 0 adds
the manifest, the file that makes a checkpoint complete, and swaps the
directory in: the old checkpoint is renamed to ``.NAME.old``, the new one
into place, and only then is the old one removed. A failure on any rank is
reported on every rank, and the old checkpoint is left as it was.

All ranks must see the same directory (a shared filesystem on multi-host).

A ``path`` that is a symbolic link is followed (:func:`resolve`): the
checkpoint replaces the directory the link points to, next to which the
temporary directories are made (on its filesystem, so that the swap is a
rename), and the link itself stays as it is.
"""

import os
import shutil
from typing import List, Sequence, Tuple

import mlx.core as mx

from .manifest import MANIFEST


def resolve(path: str) -> str:
    """The absolute directory a save to ``path`` writes: a link at ``path`` is followed."""
    path = os.path.abspath(path).rstrip(os.sep) or os.sep
    return os.path.realpath(path) if os.path.islink(path) else path


def side_paths(path: str) -> Tuple[str, str, str]:
    """``(target, temporary, old)`` absolute paths; all in the target's parent."""
    path = os.path.abspath(path).rstrip(os.sep)
    parent, base = os.path.split(path)
    return path, os.path.join(parent, f".{base}.partial"), os.path.join(parent, f".{base}.old")


def gather_status(
    group: mx.distributed.Group, ok: bool, shard: int = -1, digests: Sequence[str] = ("",)
) -> List[Tuple[bool, int, List[str]]]:
    """All ranks' ``(ok, shard written or -1, the sha256 of its files)``: a barrier
    carrying results.

    Every rank of ``group`` must call it at the same point, with as many
    ``digests`` (``""`` for a file it did not write).
    """
    data = b"".join(bytes.fromhex(d) if d else bytes(32) for d in digests)
    local = mx.array([int(ok), shard] + list(data), dtype=mx.int32)
    if group.size() == 1:
        rows = [local.tolist()]
    else:
        rows = mx.distributed.all_gather(local[None], group=group).tolist()
    return [(bool(r[0]), r[1], [bytes(r[i:i + 32]).hex() for i in range(2, len(r), 32)])
            for r in rows]


def fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_target(path: str):
    """Refuse to replace a directory that is not a checkpoint (every rank, first).

    ``path`` is :func:`resolve`-d already.
    """
    target = side_paths(path)[0]
    if os.path.islink(target):  # a link to a link that does not lead anywhere
        raise ValueError(
            f"{target} is a symbolic link whose target cannot be resolved; refusing to "
            "write through it. Remove the link or point it at a directory."
        )
    if os.path.lexists(target) and not (
        os.path.isdir(target)
        and (os.path.isfile(os.path.join(target, MANIFEST)) or not os.listdir(target))
    ):
        raise ValueError(
            f"{target} exists and is not an mlx_fsdp checkpoint (no {MANIFEST}); "
            "refusing to replace it. Choose another path or remove it."
        )


def _remove(path: str):
    # A leftover may be a link (never followed) or a directory.
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.exists(path):
        shutil.rmtree(path)


def prepare(path: str):
    """Rank 0, before anyone writes: make an empty temporary dir."""
    target, tmp, _ = side_paths(path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    _remove(tmp)  # left by an interrupted save
    os.makedirs(tmp)


def commit(path: str):
    """Rank 0, after the manifest is written: swap the complete new dir in."""
    target, tmp, old = side_paths(path)
    fsync_dir(tmp)
    _remove(old)
    if os.path.lexists(target):
        os.rename(target, old)
    os.rename(tmp, target)
    fsync_dir(os.path.dirname(target))
    _remove(old)


def abandon(path: str):
    """Rank 0, after a failure: drop the temporary dir (the target is untouched)."""
    _, tmp, _ = side_paths(path)
    shutil.rmtree(tmp, ignore_errors=True)
