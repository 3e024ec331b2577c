"""Start ``N`` ring ranks on this host without ``mlx.launch``, for timing.

``mlx.launch`` relays each rank's output through a loop that also polls the
rank's stdin pipe; a pipe is always writable, so the loop never sleeps and
keeps about one core busy for the whole run. On a small machine that core is
taken from the ranks: here (2 cores, ring N=2) one gradient computation of the
4.2M-parameter MLP took 340-390 ms under ``mlx.launch`` and 195-200 ms under
this script. The ranks are the same ring ranks either way: this script only
writes the host file and sets ``MLX_HOSTFILE`` and ``MLX_RANK``, as
``mlx.launch`` does, and relays the ranks' output a whole line at a time. As
``mlx.launch`` does, a rank that exits with an error stops the others (SIGTERM,
then SIGKILL after a grace period), so that they do not wait on it forever.
The test suite starts its ring ranks through this script for the same reason
(``tests/launch.py``).

    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_step.py --steps 60
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time


def main(argv=None) -> int:
    """Run the command on ``-n`` local ring ranks; return the first failing rank's exit code, or 0."""
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
        procs = [subprocess.Popen(command, env=dict(os.environ, MLX_HOSTFILE=f.name, MLX_RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for r in range(args.n)]
        relays = [_relay(pipe, out) for proc in procs
                  for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
        code = _wait(procs)
        for relay in relays:
            relay.join(5)
        return code
    finally:
        os.unlink(f.name)


_WRITE = threading.Lock()


def _relay(pipe, out) -> threading.Thread:
    """Copy a rank's output to ours a whole line at a time.

    Ranks writing to one shared pipe can cut each other's lines (an
    unbuffered ``print`` writes its text and its newline apart), which
    garbles the output that scripts and the tests search. The reads block,
    unlike mlx.launch's relay loop, so waiting costs no CPU.
    """
    def copy():
        for line in iter(pipe.readline, b""):
            with _WRITE:
                out.buffer.write(line)
                out.buffer.flush()
    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


#: Seconds a rank gets to exit after SIGTERM before it is killed.
GRACE = 5.0


def _wait(procs) -> int:
    """Wait for every rank; once one fails, stop the rest. Return the first failure's code."""
    failed = None
    while any(p.poll() is None for p in procs):
        if failed is None:
            failed = _first_failure(procs)
            if failed is not None:
                print(f"ring_local: rank {failed} exited with code {procs[failed].returncode}; "
                      "stopping the other ranks", file=sys.stderr, flush=True)
                _stop([p for p in procs if p.poll() is None])
        time.sleep(0.05)
    failed = _first_failure(procs) if failed is None else failed
    return 0 if failed is None else abs(procs[failed].returncode)


def _first_failure(procs):
    """The lowest rank that has exited with an error, or None."""
    return next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)


def _stop(procs):
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + GRACE
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
