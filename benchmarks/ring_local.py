"""Start ``N`` ring ranks on this host without ``mlx.launch``, for timing.

``mlx.launch`` relays each rank's output through a loop that also polls the
rank's stdin pipe; a pipe is always writable, so the loop never sleeps and
keeps about one core busy for the whole run. On a small machine that core is
taken from the ranks: here (2 cores, ring N=2) one gradient computation of the
4.2M-parameter MLP took 340-390 ms under ``mlx.launch`` and 195-200 ms under
this script. The ranks are the same ring ranks either way: this script only
writes the host file and sets ``MLX_HOSTFILE`` and ``MLX_RANK``, as
``mlx.launch`` does, and lets the ranks print straight to the terminal.

    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_step.py --steps 60
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile


def main(argv=None) -> int:
    """Run the command on ``-n`` local ring ranks and return the worst exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--starting-port", type=int, default=32323,
                   help="port of rank 0; rank r listens on the next r ports (default 32323)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the command each rank runs")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.n < 1 or not command:
        p.error("give -n >= 1 and a command after --")
    hosts = [[f"127.0.0.1:{args.starting_port + r}"] for r in range(args.n)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(hosts, f)
    try:
        procs = [subprocess.Popen(command, env=dict(os.environ, MLX_HOSTFILE=f.name, MLX_RANK=str(r)))
                 for r in range(args.n)]
        return max(abs(proc.wait()) for proc in procs)
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    sys.exit(main())
