"""One safetensors file written a few arrays at a time, never all of them in memory.

``mx.save_safetensors`` takes every array at once. A fully sharded model's
whole weights are gathered one wrapped module at a time
(:func:`mlx_fsdp.fully_sharded.gathered_by_module`), and a rank that held
them all to write one file would hold the whole model. :func:`streamed_safetensors`
takes them part by part: each part's bytes go to a scratch file as they
come, and at the end the header (which comes first in the format, and
needs every name, shape and offset) is written, followed by those bytes.
The file appears at its path only when complete.
"""

import json
import os
import shutil
import struct
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

import mlx.core as mx

from .manifest import SAFETENSORS_DTYPES

_CODES = {name: code for code, name in SAFETENSORS_DTYPES.items()}


class _Parts:
    """What :func:`streamed_safetensors` yields: ``add`` a dict of arrays at a time."""

    def __init__(self, data):
        self._data, self.header, self._offset = data, {}, 0

    def add(self, arrays: Dict[str, mx.array]):
        """Write the bytes of ``arrays`` (evaluated here) after those added before."""
        mx.eval(list(arrays.values()))
        for name, a in arrays.items():
            if name in self.header:
                raise ValueError(f"{name!r} was added twice; every name is written once.")
            code = _CODES.get(str(a.dtype).removeprefix("mlx.core."))
            if code is None:
                raise ValueError(f"{name!r} is {a.dtype}, which safetensors cannot hold; "
                                 f"cast it to one of {', '.join(_CODES)}.")
            raw = memoryview(a).tobytes()
            self._data.write(raw)
            self.header[name] = {"dtype": code, "shape": list(a.shape),
                                 "data_offsets": [self._offset, self._offset + len(raw)]}
            self._offset += len(raw)


@contextmanager
def streamed_safetensors(path: str, metadata: Optional[Dict[str, str]] = None
                         ) -> Iterator[_Parts]:
    """A safetensors file at ``path`` written from the parts ``add``-ed in the block.

    .. code-block:: python

        with streamed_safetensors("model.safetensors") as out:
            for part in gathered_by_module(model):
                out.add(part)

    Args:
        path (str): The file; it appears once the block ends without an error.
        metadata (dict, optional): The header's ``__metadata__`` (strings).
            Default: ``None``.
    """
    path = os.path.abspath(path)
    folder, name = os.path.split(path)
    scratch = os.path.join(folder, f".{name}.data.partial")
    partial = os.path.join(folder, f".{name}.partial")
    try:
        with open(scratch, "wb") as data:
            parts = _Parts(data)
            yield parts
        header = dict(parts.header)
        if metadata:
            header["__metadata__"] = dict(metadata)
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
        with open(partial, "wb") as out, open(scratch, "rb") as data:
            out.write(struct.pack("<Q", len(text)) + text)
            shutil.copyfileobj(data, out, 1 << 24)
        os.replace(partial, path)
    finally:
        for leftover in (scratch, partial):
            if os.path.exists(leftover):
                os.remove(leftover)
