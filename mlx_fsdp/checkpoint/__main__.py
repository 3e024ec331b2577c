"""``python -m mlx_fsdp.checkpoint consolidate PATH OUT``."""

import argparse
import sys

from .consolidate import consolidate_checkpoint
from .manifest import CheckpointError


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mlx_fsdp.checkpoint")
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser(
        "consolidate",
        help="write one safetensors file with the model and the optimizer state in "
        "plain MLX layout (keys model.*, optimizer.*, master.*)",
    )
    c.add_argument("path", help="checkpoint directory")
    c.add_argument("out", help="output .safetensors file")
    args = parser.parse_args(argv)
    try:
        out = consolidate_checkpoint(args.path, args.out)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
