"""Checks of manifest values that raise errors naming the manifest and the field.

:class:`Fields` checks one value at a time (its type, its range, its
equality with another field) and raises a
:class:`~mlx_fsdp.checkpoint.manifest.CheckpointError` such as
``manifest field files['../x']: ...``; :mod:`.schema` walks the manifest with it.
"""

from typing import List, Optional

from .manifest import CheckpointError

#: Names of the dtypes a checkpoint may hold.
DTYPES = frozenset({
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64", "complex64",
})


class Fields:
    """Checks values of one manifest, raising errors that name the manifest and the field."""

    def __init__(self, file: str):
        self.file = file

    def fail(self, where: str, problem: str):
        raise CheckpointError(
            f"The checkpoint manifest {self.file} is invalid: manifest field {where} {problem}. "
            "The manifest was edited or damaged; restore it from the original save."
        )

    def get(self, obj: dict, key: str, where: str, *, optional: bool = False, default=None):
        if key not in obj:
            if optional:
                return default
            self.fail(f"{where}.{key}" if where else key, "is missing")
        return obj[key]

    def dict(self, value, where: str) -> dict:
        if not isinstance(value, dict):
            self.fail(where, f"must be a JSON object, not {show(value)}")
        return value

    def list(self, value, where: str) -> list:
        if not isinstance(value, list):
            self.fail(where, f"must be a JSON list, not {show(value)}")
        return value

    def int(self, value, where: str, low: int = 0, high: Optional[int] = None) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(where, f"must be an integer, not {show(value)}")
        if value < low or (high is not None and value >= high):
            bound = f"in [{low}, {high})" if high is not None else f">= {low}"
            self.fail(where, f"is {value}, which is not {bound}")
        return value

    def str(self, value, where: str, choices=None) -> str:
        if not isinstance(value, str) or not value:
            self.fail(where, f"must be a non-empty string, not {show(value)}")
        if choices is not None and value not in choices:
            self.fail(where, f"is {value!r}, not one of {', '.join(map(repr, choices))}")
        return value

    def shape(self, value, where: str) -> List[int]:
        self.list(value, where)
        for i, d in enumerate(value):
            self.int(d, f"{where}[{i}]")
        return value

    def dtype(self, value, where: str) -> str:
        return self.str(value, where, sorted(DTYPES))

    def equal(self, value, expected, where: str, what: str):
        if value != expected:
            self.fail(where, f"is {show(value)}, but {what} is {show(expected)}")


def show(value) -> str:
    """``repr(value)``, cut to 60 characters for a message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
