"""Agreement between ranks at the library's synchronization points.

Every place where all ranks must arrive together (each optimizer step,
``save_checkpoint``, ``load_checkpoint``, ``init``) exchanges one small,
fixed-size control message with one ``all_gather`` and reads it on the host.
The message says which operation this rank is in and what it must agree on
(the plan, the optimizer's class and hyper-parameters, the current learning
rate, the step count...). Because every operation sends the same fixed-size
message, ranks that are in *different* operations (rank 0 in
``save_checkpoint``, rank 1 in ``update``) still exchange well-formed
messages, and every rank raises the same :class:`RankMismatch`, naming the
operation or setting that differs and the ranks, instead of hanging or
summing unrelated numbers.

Values are encoded as int32 words: integers as they are, floats by their
float32 bits (so they compare exactly), strings and other values by a 31-bit
hash. When a hashed field differs, every rank sees it in the same gathered
rows, so all of them take part in a second gather of the readable values
that the error message then shows.
"""

import math
import struct
import zlib
from typing import Dict, List, Optional, Sequence, Union

import mlx.core as mx

#: Marks a control message ("FSDP" in ASCII); a row without it is other data.
MAGIC = 0x46534450
#: int32 words per message: magic, operation, then the fields.
WORDS = 24
#: Bytes of each readable value gathered to explain a mismatch.
TEXT_BYTES = 96

OPERATIONS = ("update", "save_checkpoint", "load_checkpoint", "init", "apply_gradients",
              "fully_shard", "exit")

#: Ranks seen in ``"exit"`` (their script ended): they leave without waiting
#: for the others (see :mod:`mlx_fsdp.ending`).
LEFT = set()

Value = Union[int, float, str, None]


class RankMismatch(ValueError):
    """Ranks that must agree do not: raised on every rank, with the same message."""


class PeerLost(RuntimeError):
    """A peer left while this rank waited at a synchronization point."""


def _hash(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _encode(value: Value) -> int:
    if value is None:
        return -(1 << 31)
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value if -(1 << 31) < value < (1 << 31) else _hash(repr(value))
    if isinstance(value, float):
        if math.isnan(value):
            return 0x7FC00001
        return struct.unpack("<i", struct.pack("<f", value))[0]
    return _hash(str(value))


def _readable(value: Value) -> str:
    if isinstance(value, float):
        return f"{value:.9g}"
    return str(value)


def _gather(words: List[int], group, stream) -> List[List[int]]:
    local = mx.array(words, dtype=mx.int32)[None]
    try:
        rows = mx.distributed.all_gather(local, group=group, stream=stream)
        return rows.reshape(group.size(), -1).tolist()
    except RuntimeError as e:
        raise PeerLost(str(e)) from e


def _text(values: Sequence[Value], group, stream) -> List[List[str]]:
    """Every rank's readable ``values``, gathered (only on the error path)."""
    words = []
    for v in values:
        raw = _readable(v).encode()[: TEXT_BYTES - 1]
        words += list(raw) + [0] * (TEXT_BYTES - len(raw))
    rows = _gather(words, group, stream)
    out = []
    for row in rows:
        texts = []
        for i in range(len(values)):
            raw = bytes(b for b in row[i * TEXT_BYTES:(i + 1) * TEXT_BYTES] if 0 < b < 256)
            texts.append(raw.decode(errors="replace"))
        out.append(texts)
    return out


def _raise_together(error: Exception, group, stream):
    # A rank that raises exits, and closing its connections can cut a slower
    # peer's last gather short; one more tiny gather makes sure every rank
    # has what it needs for the same message before any of them raises.
    try:
        _gather([0], group, stream)
    except PeerLost:
        pass
    raise error


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def agree(
    group: mx.distributed.Group,
    operation: str,
    fields: Dict[str, Value],
    *,
    stream: Optional[mx.Stream] = None,
    hint: str = "",
) -> None:
    """Check that every rank of ``group`` is in ``operation`` with equal ``fields``.

    Every rank of ``group`` must call it at the same point (it evaluates one
    small all-gather). With one rank it returns at once.

    Args:
        group (mlx.core.distributed.Group): The ranks that must agree.
        operation (str): One of :data:`OPERATIONS`: where this rank is.
        fields (dict): ``{name: value}`` that must be equal on every rank, in
            the same order on every rank (the same code builds them). At most
            ``WORDS - 2`` fields.
        stream (mlx.core.Stream, optional): Stream of the gather; the one the
            caller's other collectives use, so that they stay in order.
            Default: ``None``.
        hint (str): Appended to a mismatch message: what the user should
            check. Default: ``""``.

    Raises:
        RankMismatch: On every rank, if ranks are in different operations, a
            rank sent something that is not a control message, or a field
            differs. The message names the operation or field and the ranks.
        PeerLost: If the gather failed because a peer left.
    """
    if group.size() == 1:
        return
    if len(fields) > WORDS - 2:
        raise ValueError(f"{len(fields)} fields do not fit a control message of {WORDS} words.")
    op = OPERATIONS.index(operation)
    names, values = list(fields), list(fields.values())
    words = [MAGIC, op] + [_encode(v) for v in values]
    words += [0] * (WORDS - len(words))
    try:
        rows = _gather(words, group, stream)
    except PeerLost as e:
        raise PeerLost(
            f"A peer left while this rank (rank {group.rank()}) waited in {operation} ({e}). "
            f"Every rank must call {operation} at the same point: another rank exited, "
            "crashed, or skipped the call."
        ) from e
    strangers = [r for r, row in enumerate(rows) if row[0] != MAGIC]
    if strangers:  # they may be in a collective of another size: no barrier
        raise RankMismatch(
            f"In {operation}, {_ranks(strangers)} sent data that is not an mlx_fsdp control "
            "message: those ranks are running another collective (for example the step of an "
            "update, or a save, that the other ranks did not call), or exited. Every rank must call "
            "update, save_checkpoint and load_checkpoint the same number of times, in the same order."
        )
    ops = [row[1] for row in rows]
    if len(set(ops)) > 1:
        where = "; ".join(
            f"{_ranks([r for r, o in enumerate(ops) if o == code])} in "
            f"{OPERATIONS[code] if 0 <= code < len(OPERATIONS) else '?'}"
            for code in sorted(set(ops))
        )
        calls = sorted({OPERATIONS[c] for c in set(ops) if 0 <= c < len(OPERATIONS)} - {"exit"})
        left = [r for r, o in enumerate(ops) if o == OPERATIONS.index("exit")]
        LEFT.update(left)
        advice = (f"every rank must call {' and '.join(calls)} at the same point (for example "
                  "save_checkpoint on every rank, not only on rank 0).")
        if left:
            advice = (f"the script of {_ranks(left)} ended (or an error ended it) while the others "
                      f"still call {' and '.join(calls)}: every rank must make the same calls to "
                      "update, save_checkpoint and load_checkpoint, in the same order.")
        _raise_together(RankMismatch(
            f"The ranks are at different synchronization points: {where}. {advice[0].upper()}"
            f"{advice[1:]}"), group, stream)
    differ = [i for i in range(len(names)) if len({row[2 + i] for row in rows}) > 1]
    if not differ:
        return
    try:
        texts = _text([values[i] for i in differ], group, stream)
    except PeerLost:  # a peer already left: name the settings without their values
        texts = [["(differs)"] * len(differ) for _ in rows]
    parts = []
    for j, i in enumerate(differ):
        by_value: Dict[str, List[int]] = {}
        for r, t in enumerate(texts):
            by_value.setdefault(t[j], []).append(r)
        parts.append(f"{names[i]}: " + ", ".join(f"{_ranks(rs)} {v}" for v, rs in by_value.items()))
    _raise_together(RankMismatch(
        f"The ranks disagree in {operation}: " + "; ".join(parts) + ". Every rank must use the "
        "same settings and the same state." + (f" {hint}" if hint else "")
    ), group, stream)
