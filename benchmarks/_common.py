"""What the benchmark scripts share: the MLP they time and how they write results."""

import json

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
