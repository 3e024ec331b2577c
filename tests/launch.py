"""Launch real ranks from pytest: ring at N=2, MPI for N=3..8, always under a hard timeout."""

import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKERS = os.path.join(HERE, "workers")


def _mlx_launch():
    local = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    return local if os.path.exists(local) else shutil.which("mlx.launch")


def mpi_env():
    """The environment for MPI ranks.

    MLX opens ``libmpi.so``; Debian's openmpi-bin ships only ``libmpi.so.40``
    (the bare name comes with libopenmpi-dev), so point MLX_MPI_LIBNAME at it.
    """
    env = dict(os.environ)
    if "MLX_MPI_LIBNAME" not in env:
        libs = glob.glob("/usr/lib/*/libmpi.so") + glob.glob("/usr/lib/*/libmpi.so.[0-9]*")
        libs = [lib for lib in libs if "libmpi.so" in os.path.basename(lib)]
        if libs:
            env["MLX_MPI_LIBNAME"] = os.path.basename(sorted(libs, key=len)[0])
    return env


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152  # the IANA range's start, which macOS uses


def _free_ports(count: int) -> int:
    """A first port of ``count`` consecutive free ones.

    mlx.launch's ring listens on 32323, 32324, ... by default; two ring jobs
    started at once on one machine (parallel test runs, a benchmark next to
    the tests) would then connect to each other's ranks and hang. The ports
    are drawn below the kernel's ephemeral range: any outgoing connection
    may take a port in that range between this check and the ring's bind.
    """
    top = max(_ephemeral_low(), 20000)
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(10000, top - count)
        try:
            for port in range(first, first + count):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"found no {count} consecutive free TCP ports for the ring backend")


#: Ring ranks start through this script, which sets what mlx.launch sets and,
#: like it, stops the other ranks when one fails; mlx.launch's relay loop
#: keeps a core busy for the whole job (see the script): on 2 cores the suite
#: took 10-12.5 minutes through it, 8 without (2026-11-27).
#: MLX_FSDP_TEST_MLX_LAUNCH=1 starts them through mlx.launch instead.
RING_LOCAL = os.path.join(ROOT, "benchmarks", "ring_local.py")

#: Set for every rank: exactness tests compare float32 results, and MLX's CUDA
#: build runs float32 matmuls in TF32 unless told otherwise.
RANK_ENV = {"MLX_ENABLE_TF32": "0"}


def command(n: int, script: str, args, backend: str, env_keys=(), mlx_launch=False):
    path = os.path.join(WORKERS, script)  # an absolute script path is kept as is
    if n == 1:  # one plain process: no launcher (mpirun -n 1 aborts at exit)
        return [sys.executable, path, *args]
    if backend == "ring" and (mlx_launch or os.environ.get("MLX_FSDP_TEST_MLX_LAUNCH") == "1"):
        launcher = _mlx_launch()
        if launcher is None:
            pytest.fail("mlx.launch was not found next to the Python interpreter or on PATH")
        return [launcher, "-n", str(n), "--backend", "ring", "--starting-port", str(_free_ports(n)),
                "--", sys.executable, path, *args]
    if backend == "ring":
        return [sys.executable, RING_LOCAL, "-n", str(n), "--starting-port", str(_free_ports(n)),
                "--", sys.executable, path, *args]
    if backend == "mpi":
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            pytest.fail("mpirun is not installed: apt-get install -y openmpi-bin (see .ci/run)")
        exported = ["MLX_MPI_LIBNAME", "PYTHONPATH", *RANK_ENV, *env_keys]
        return [mpirun, "--allow-run-as-root", "--oversubscribe",
                *[a for k in exported for a in ("-x", k)], "-n", str(n), sys.executable, path, *args]
    raise ValueError(f"backend={backend!r} must be 'ring' or 'mpi'")


def _launch(n: int, script: str, args, backend: str, timeout: float, cwd: str, extra_env=None,
            mlx_launch=False):
    """Run ``script`` on ``n`` ranks; return (returncode, output, command) or fail on a hang."""
    env = mpi_env()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(RANK_ENV)
    env.update(extra_env or {})
    for _ in range(3):
        result = _launch_once(n, script, args, backend, timeout, cwd, env, extra_env, mlx_launch)
        code, out = result[:2]
        # Another process can still take a port between _free_ports' check
        # and the ring's bind; that is the harness's race, not the test's.
        if not (backend == "ring" and code != 0 and _BIND_FAILED in out):
            return result
    return result


#: What the ring backend prints when a port it was given is taken.
_BIND_FAILED = "Couldn't bind socket"


def _launch_once(n, script, args, backend, timeout, cwd, env, extra_env, mlx_launch):
    cmd = command(n, script, [str(a) for a in args], backend, list(extra_env or {}), mlx_launch)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    start, aborted = time.monotonic(), None
    while True:
        try:
            proc.wait(0.2)  # returns as soon as the job ends, where a sleep would not
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if aborted is None and any(_ABORTED in line for line in lines[-50:]):
            aborted = now
        # Open MPI sometimes does not exit after it aborted the job (a rank
        # left in MPI_Finalize): the ranks have stopped, which is what the
        # tests check, so the harness ends the launcher after a grace period.
        if aborted is not None and now - aborted > ABORT_GRACE:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            lines.append(f"(mpirun did not exit {ABORT_GRACE:.0f} s after aborting the job; "
                         "the test harness killed it)\n")
            break
        if now - start > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(5)
            out = "".join(lines)
            pytest.fail(
                f"HANG: {script} on {n} ranks ({backend}) did not finish in {timeout:.0f}s; "
                f"a collective is probably waiting on a rank that never joined.\n"
                f"command: {' '.join(cmd)}\n--- output ---\n{out[-4000:]}"
            )
    reader.join(5)
    out = "".join(lines)
    return _rank_failure(proc.returncode, out), out, cmd


#: What mpirun prints when it aborts a job, and how long it may then take to exit.
_ABORTED = "the job has been aborted"
ABORT_GRACE = 20.0

# mlx.launch exits with 0 even when a rank fails; it says so in a warning line.
_RANK_EXIT = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")


def _rank_failure(code: int, out: str) -> int:
    """The launcher's exit code, or a rank's non-zero one that the launcher did not pass on."""
    if code == 0:
        codes = [int(c) for _, c in _RANK_EXIT.findall(out) if int(c) != 0]
        return codes[0] if codes else 0
    return code


def run_ranks(n: int, script: str, args=(), *, backend: str = None, timeout: float = 240,
              expect_failure: bool = False, env: dict = None):
    """Run ``tests/workers/<script>`` on ``n`` ranks and return rank 0's RESULT records.

    Args:
        n: Number of ranks. Default backend: ring for 2, MPI for 3..8, none for 1.
        script: File name in tests/workers.
        args: Extra command-line arguments.
        backend: "ring" or "mpi". Default: chosen from ``n``.
        timeout: Seconds before the whole launch is killed and the test fails
            with a message naming the hang.
        expect_failure: Return (returncode, output) instead of asserting success.
        env: Extra environment variables for every rank.
    """
    backend = backend or ("ring" if n == 2 else "mpi")
    with tempfile.TemporaryDirectory() as tmp:
        results_file = os.path.join(tmp, "results.jsonl")
        env = {**(env or {}), "MLX_FSDP_TEST_RESULTS": results_file}
        code, out, cmd = _launch(n, script, args, backend, timeout, WORKERS, env)
        if expect_failure:
            return code, out
        if code != 0:
            pytest.fail(f"{script} on {n} ranks ({backend}) exited with {code}\n"
                        f"command: {' '.join(cmd)}\n--- output ---\n{out[-6000:]}")
        lines = open(results_file).read().splitlines() if os.path.exists(results_file) else []
    results = [json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT ")]
    assert results, f"{script} printed no RESULT line:\n{out[-4000:]}"
    return results


def run_script(n: int, path: str, args=(), *, backend: str = None, timeout: float = 240,
               cwd: str = ROOT, env: dict = None, mlx_launch: bool = False) -> str:
    """Run any script (path relative to the repository root) on ``n`` ranks; return its output.

    ``n == 1`` runs it as one plain process. The launch must succeed; a hang
    fails the test with a ``HANG`` message, as in :func:`run_ranks`. ``env``:
    extra environment variables for the script. ``mlx_launch``: start ring
    ranks through ``mlx.launch``, as a README command does.
    """
    path = os.path.join(ROOT, path)
    if n == 1:
        cmd = [sys.executable, path, *[str(a) for a in args]]
        plain = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                     **(env or {}))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=plain, cwd=cwd,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"HANG: {' '.join(cmd)} did not finish in {timeout:.0f}s\n{e.stdout}")
        code, out = proc.returncode, proc.stdout + proc.stderr
    else:
        backend = backend or ("ring" if n == 2 else "mpi")
        code, out, cmd = _launch(n, path, args, backend, timeout, cwd, env, mlx_launch)
    if code != 0:
        pytest.fail(f"{os.path.basename(path)} on {n} rank(s) exited with {code}\n"
                    f"command: {' '.join(cmd)}\n--- output ---\n{out[-6000:]}")
    return out
