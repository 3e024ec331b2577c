"""What the benchmark scripts share: the MLP they time, progress lines and how they write results."""

import json
import sys
import time

import mlx.nn as nn


class MLP(nn.Module):
    """A stack of ``layers`` square ``Linear`` layers with ReLU in between.

    Args:
        hidden (int): Input width, hidden width and number of classes.
        layers (int): Number of ``Linear(hidden, hidden)`` layers (>= 1).
    """

    def __init__(self, hidden: int, layers: int):
        super().__init__()
        self.layers = [nn.Linear(hidden, hidden) for _ in range(layers)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nn.relu(layer(x))
        return self.layers[-1](x)


def publish(header: str, table: str, markdown_path=None, json_path=None, record=None):
    """Print ``header`` and the markdown ``table``; also write them and ``record``.

    Args:
        header (str): One line saying what was measured.
        table (str): The markdown table.
        markdown_path (str, optional): Write header and table here. Default: ``None``.
        json_path (str, optional): Write ``record`` here as JSON. Default: ``None``.
        record (dict, optional): The numbers behind the table. Default: ``None``.
    """
    print(header)
    print()
    print(table)
    if markdown_path:
        with open(markdown_path, "w") as fh:
            fh.write(header + "\n\n" + table + "\n")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(record, fh, indent=2)


class Progress:
    """Rank 0's progress through a fixed number of steps, as lines on stderr.

    A line goes out at most every ``every`` seconds and once at the end, so a
    long run shows it is alive and a short one prints a single line; stdout
    stays for the results.

    Args:
        label (str): What is running, at the start of each line.
        total (int): Steps the work takes.
        enabled (bool): Print at all (``rank == 0``). Default: ``True``.
        unit (str): What a step is called. Default: ``"steps"``.
        every (float): Seconds between lines. Default: ``5.0``.
    """

    def __init__(self, label: str, total: int, *, enabled: bool = True, unit: str = "steps",
                 every: float = 5.0):
        self.label, self.total, self.enabled, self.unit, self.every = label, total, enabled, unit, every
        self.done = 0
        self.start = self.last = time.perf_counter()

    def advance(self, count: int = 1):
        """Count ``count`` more finished steps; print a line when one is due."""
        self.done += count
        now = time.perf_counter()
        if self.enabled and (now - self.last >= self.every or self.done == self.total):
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            print(f"  {self.label}: {self.done}/{self.total} {self.unit}, {rate:.2f} {self.unit}/s",
                  file=sys.stderr, flush=True)
