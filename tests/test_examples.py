"""What users run: the training example, the comparison and the benchmarks, on tiny settings.

The launches are real (ring at N=2, MPI at N=4, one plain process); the
checks are on what the scripts print and write: a loss that does not depend
on the number of ranks, FSDP losses equal to DDP's, a learning-rate schedule
that ends at its floor, Muon's two rates, checkpoint paths and the warning on
resuming with another schedule, the comparison's noise floor, the benchmark's
GPT rows and update-hold columns, progress lines, valid JSON, markdown and
PNG files.
"""

import json
import math
import os
import re
import shutil
import struct
import sys

import mlx.core as mx
import pytest

from launch import ROOT, run_script

sys.path.insert(0, os.path.join(ROOT, "examples"))
import lm  # noqa: E402

TINY = ["--batch-size", 4, "--seq-len", 16, "--dims", 16, "--layers", 1, "--heads", 2,
        "--max-data-bytes", "256KiB", "--log-every", 1]
PROGRESS = re.compile(
    r"^\[(ddp|fsdp|fully_shard)\] step\s+(\d+) \| loss\s+(\S+) \|\s+(\d+) tok/s \|\s+(\S+) ms/step \| "
    r"peak\s+(\S+) MiB \| lr (\S+)(?: \| muon lr (\S+))?$"
)


def progress(out: str):
    """``{mode: [(step, loss, ms, peak MiB, lr, muon lr or None), ...]}`` from rank 0's progress lines."""
    runs = {}
    for line in out.splitlines():
        m = PROGRESS.match(line.strip())
        if m:
            mode, step, loss, _, ms, peak, lr, muon = m.groups()
            runs.setdefault(mode, []).append((int(step), float(loss), float(ms), float(peak), float(lr),
                                              None if muon is None else float(muon)))
    return runs


def test_corpus_from_a_file_and_a_folder(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"world")
    (tmp_path / "a.txt").write_bytes(b"hello ")
    assert lm.load_corpus(str(tmp_path / "a.txt")).tobytes() == b"hello "
    assert lm.load_corpus(str(tmp_path)).tobytes() == b"hello world"  # sorted order
    assert lm.load_corpus(str(tmp_path), max_bytes=8).tobytes() == b"hello wo"
    with pytest.raises(ValueError, match="neither a file nor a folder"):
        lm.load_corpus(str(tmp_path / "missing"))


def test_default_corpus_is_python_source():
    data = lm.load_corpus(None, max_bytes=100_000)
    assert len(data) == 100_000
    assert b"def " in data.tobytes() and b"import " in data.tobytes()


def test_rank_slices_tile_the_global_batch():
    data = lm.load_corpus(None, max_bytes=10_000)
    x, y = lm.global_batch(data, 3, 8, 5, seed=1)
    assert (x[:, 1:] == y[:, :-1]).all()
    parts = [lm.rank_slice((x, y), r, 4) for r in range(4)]
    assert [p[0].tolist() for p in parts] == [x[2 * r:2 * r + 2].tolist() for r in range(4)]
    with pytest.raises(ValueError, match="must divide by the number of ranks 3"):
        lm.rank_slice((x, y), 0, 3)


@pytest.mark.parametrize("peak,warmup,steps", [(3e-3, 5, 20), (1.0, 0, 10), (0.02, 2, 4)])
def test_schedule_warms_up_then_decays_to_its_floor_on_the_last_step(peak, warmup, steps):
    lr = lm.schedule(peak, warmup, steps)
    rates = [lr(s).item() for s in range(steps)]
    assert rates[-1] == pytest.approx(0.1 * peak, rel=1e-6)  # the last step is at the 10 % floor
    assert rates[warmup] == pytest.approx(peak, rel=1e-6)
    assert all(a > b for a, b in zip(rates[warmup:], rates[warmup + 1:])), rates
    assert [pytest.approx((s + 1) / warmup * peak) for s in range(warmup)] == rates[:warmup]


def test_plural():
    assert lm.plural(1, "rank") == "1 rank" and lm.plural(2, "rank") == "2 ranks"
    assert lm.plural(3, "micro-batch", "es") == "3 micro-batches"


def test_communication_size_units():
    assert lm.parse_size("32MiB") == 32 * 1024**2
    assert lm.parse_size("512KiB") == 512 * 1024 and lm.parse_size("1000") == 1000


def test_train_loss_does_not_depend_on_the_number_of_ranks():
    args = ["--steps", 4, *TINY]
    one = progress(run_script(1, "examples/train.py", [*args, "--mode", "ddp"]))["ddp"]
    out2 = run_script(2, "examples/train.py", [*args, "--mode", "fsdp"])
    two = progress(out2)["fsdp"]
    four = progress(run_script(4, "examples/train.py", [*args, "--mode", "fsdp"]))["fsdp"]
    assert [r[0] for r in one] == [1, 2, 3, 4]
    for a, b, c in zip(one, two, four):
        assert math.isfinite(a[1]) and abs(a[1] - b[1]) <= 2e-4 and abs(a[1] - c[1]) <= 2e-4
        assert a[4] == b[4] == c[4] > 0  # the same learning-rate schedule
        assert b[2] > 0 and b[3] > 0     # step ms, peak MiB
    assert one[-1][1] < one[0][1], "the loss must fall"
    summary = [line for line in out2.splitlines() if line.startswith("done:")]
    assert len(summary) == 1 and "optimizer state" in summary[0] and "tok/s" in summary[0]


@pytest.mark.parametrize("flags", [
    ["--optimizer", "muon"],
    ["--optimizer", "adafactor", "--dtype", "bfloat16"],
    ["--grad-accumulation-steps", "2", "--accumulation", "sharded"],
])
def test_train_features_match_ddp_on_two_ranks(flags):
    # Owner placement, fp32 masters of a bf16 model and sharded accumulation,
    # each against the same run under ddp_step (one process: its own reference).
    args = ["--steps", 3, *TINY, *flags]
    ddp = progress(run_script(1, "examples/train.py", [*args, "--mode", "ddp"]))["ddp"]
    fsdp = progress(run_script(2, "examples/train.py", [*args, "--mode", "fsdp"]))["fsdp"]
    assert [r[0] for r in fsdp] == [1, 2, 3]
    tol = 2e-2 if "bfloat16" in flags else 2e-4
    for a, b in zip(ddp, fsdp):
        assert math.isfinite(b[1]) and abs(a[1] - b[1]) <= tol, (a, b)


@pytest.mark.parametrize("n, flags", [
    (2, []),
    (3, ["--optimizer", "muon", "--reshard-after-forward", "--max-norm", "1", "--batch-size", 6]),
])
def test_fully_sharded_training_matches_ddp(n, flags):
    # Every block, then the model, wrapped with fully_shard: the same losses as DDP
    args = ["--steps", 3, *TINY, "--layers", 2, *flags]
    ddp = progress(run_script(1, "examples/train.py", [*args, "--mode", "ddp"]))["ddp"]
    fully = progress(run_script(n, "examples/train.py", [*args, "--mode", "fully_shard"]))
    assert [r[0] for r in fully["fully_shard"]] == [1, 2, 3]
    for a, b in zip(ddp, fully["fully_shard"]):
        assert math.isfinite(b[1]) and abs(a[1] - b[1]) <= 2e-4, (a, b)


def test_checkpoint_round_trip_example_loads_a_fully_sharded_model_unsharded(tmp_path):
    saved = run_script(2, "examples/checkpoint_round_trip.py", ["save", tmp_path / "ck"])
    loaded = run_script(1, "examples/checkpoint_round_trip.py", ["load", tmp_path / "ck"])
    norm = re.compile(r"step 1, \|weights\|\^2 = (\S+)")
    assert norm.search(saved).group(1) == norm.search(loaded).group(1), (saved, loaded)
    assert "model-00001-of-00002.safetensors" in os.listdir(tmp_path / "ck")


def test_muon_logs_both_rates_down_to_the_floor():
    # One process: the header and the progress lines are rank 0's either way.
    out = run_script(1, "examples/train.py", ["--steps", 3, "--warmup-steps", 1, *TINY,
                                              "--optimizer", "muon", "--muon-learning-rate", 0.02])
    header = out.splitlines()[0]
    assert "muon lr 0.02 (hidden matrices), adamw lr 0.003 (the rest)" in header, header
    rows = progress(out)["fsdp"]
    assert [(r[4], r[5]) for r in rows] == [(3e-3, 0.02), (3e-3, 0.02), (3e-4, 2e-3)]


def test_train_resumes_from_a_checkpoint_at_another_world_size(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    args = [*TINY, "--checkpoint-dir", ckpt]
    full = progress(run_script(1, "examples/train.py", ["--steps", 4, *TINY, "--mode", "ddp"]))["ddp"]
    saving = run_script(2, "examples/train.py", ["--steps", 4, "--save-every", 2, *args])
    assert sorted(os.listdir(ckpt)) == ["step_000002", "step_000004"]
    # Rank 0 alone names each checkpoint as it is written, after that step's line.
    lines = [line.strip() for line in saving.splitlines()]
    step_lines = [i for i, line in enumerate(lines) if PROGRESS.match(line)]  # one per step (--log-every 1)
    for step in (2, 4):
        saved = f"[fsdp] saved {os.path.join(ckpt, f'step_{step:06d}')}"
        assert lines.count(saved) == 1, saving
        assert step_lines[step - 1] < lines.index(saved), saving
    # Drop the last checkpoint: resume at step 2 with one process, run to 4.
    shutil.rmtree(os.path.join(ckpt, "step_000004"))
    out = run_script(1, "examples/train.py", ["--steps", 4, "--resume", *args])
    resumed = progress(out)["fsdp"]
    assert "resumed from" in out and [r[0] for r in resumed] == [3, 4]
    assert "warning" not in out  # the same schedule
    for a, b in zip(full[2:], resumed):
        assert abs(a[1] - b[1]) <= 2e-4 and a[4] == b[4], (a, b)


def test_resuming_with_other_steps_warns_that_the_schedule_changed(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    args = [*TINY, "--warmup-steps", 1, "--checkpoint-dir", ckpt]
    run_script(1, "examples/train.py", ["--steps", 4, "--save-every", 2, *args])
    shutil.rmtree(os.path.join(ckpt, "step_000004"))
    out = run_script(1, "examples/train.py", ["--steps", 8, "--resume", *args])
    warning = [line for line in out.splitlines() if "warning" in line]
    assert len(warning) == 1 and "the schedule's length differs from the saved run's" in warning[0]
    assert "--steps 4 -> 8" in warning[0] and "resume with --steps 4" in warning[0]
    # The run follows its own flags, as the warning says: 8 steps' schedule from step 3 on.
    lr = lm.schedule(3e-3, 1, 8)
    rows = progress(out)["fsdp"]
    assert [r[0] for r in rows] == list(range(3, 9))
    assert [r[4] for r in rows] == [float(f"{lr(s - 1).item():.2e}") for s in range(3, 9)]
    assert f"lr {lr(2).item():.2e} (saved run's schedule: {lm.schedule(3e-3, 1, 4)(2).item():.2e})" in warning[0]


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", "not a PNG file"
    return struct.unpack(">II", head[16:24])


def test_compare_two_ranks_writes_agreeing_curves_and_a_plot(tmp_path):
    steps = 8
    out = run_script(2, "examples/compare_ddp_fsdp.py",
                     ["--steps", steps, "--out", tmp_path, "--log-every", 4, "--max-norm", 1.0,
                      "--checkpoint-dir", tmp_path / "ckpt"])
    with open(tmp_path / "compare.json") as f:
        res = json.load(f)
    assert {"ddp", "fsdp", "ddp_repeat", "config"} <= set(res)
    assert res["config"]["world_size"] == 2 and res["config"]["steps"] == steps
    on_cpu = mx.default_device() == mx.cpu
    if on_cpu:
        # On the CPU two DDP runs of one seed are bitwise equal: the floor is 0 and the tolerance applies.
        assert res["ddp_repeat"]["loss"] == res["ddp"]["loss"]
        assert res["noise_floor"] == 0
    # A GPU's reductions are not bitwise repeatable (seen on an H200), so there
    # the limit is the larger of the tolerance and the measured DDP/DDP floor.
    assert res["tolerance"] == 1e-3 and res["limit"] == max(1e-3, res["noise_floor"])
    assert res["within"] is True
    for mode in ("ddp", "fsdp", "fully_shard", "ddp_repeat"):
        run = res[mode]
        assert len(run["loss"]) == len(run["step_ms"]) == steps
        assert all(math.isfinite(v) for v in run["loss"]) and min(run["step_ms"]) > 0
        assert run["peak_memory"] > 0 and run["loss"][-1] < run["loss"][0] - 0.5
    for mode in ("fsdp", "fully_shard"):
        assert all(abs(d - f) <= res["limit"] for d, f in zip(res["ddp"]["loss"], res[mode]["loss"]))
        assert res[mode]["state_bytes"] <= res["ddp"]["state_bytes"] * (0.5 + 0.02)
        assert re.search(rf"^\| {mode} \| [\d.]+ \| [\d.]+ \|", out, re.M), out
    # Only fully_shard shards the parameters themselves.
    assert res["fsdp"]["param_bytes"] == res["ddp"]["param_bytes"]
    assert res["fully_shard"]["param_bytes"] <= res["ddp"]["param_bytes"] * (0.5 + 0.02)
    assert "DDP vs FSDP on 2 ranks:" in out
    assert "max |FSDP - DDP| loss over all steps" in out and (not on_cpu or "within 0.001" in out)
    assert "max |fully sharded - DDP| loss over all steps" in out
    assert re.search(r"fully sharded / DDP: parameters 0\.5\d\dx, optimizer state", out), out
    assert not on_cpu or ("noise floor, max |DDP - DDP| loss of two DDP runs with the same seed: 0.00e+00; "
                          "FSDP judged against the tolerance 0.001 (larger than the noise floor)") in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "pip install -e '.[plot]'" in out
        return
    width, height = _png_size(tmp_path / "compare.png")
    assert width >= 600 and height >= 400
    assert os.path.getsize(tmp_path / "compare.png") > 20_000


def test_compare_judges_fsdp_against_a_noise_floor_above_the_tolerance():
    # What a GPU gives (two DDP runs drift apart): the floor, not 1e-3, is the limit.
    import compare_ddp_fsdp as compare  # examples/ is on sys.path (see the top)

    run = {"loss": [5.0, 4.0, 3.0], "step_ms": [9.0, 2.0, 2.0], "peak_memory": 2**20,
           "state_bytes": 2**20, "first_step": 0}
    runs = {"ddp": run, "fsdp": {**run, "loss": [5.0, 4.004, 3.006]},
            "ddp_repeat": {**run, "loss": [5.0, 3.995, 3.008]}}
    summary = compare.summarize(runs)
    assert summary["noise_floor"] == pytest.approx(0.008) and summary["limit"] == summary["noise_floor"]
    assert summary["limit_source"] == "noise floor" and summary["within"]
    text = compare.table(summary, 2)
    assert "max |FSDP - DDP| loss over all steps: 6.00e-03 (within 0.008)" in text
    assert "FSDP judged against the noise floor (larger than the tolerance 0.001)" in text
    runs["fsdp"]["loss"][2] = 3.01
    assert "(ABOVE 0.008)" in compare.table(compare.summarize(runs), 2)


def test_compare_without_matplotlib_still_writes_json(tmp_path, monkeypatch):
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text("raise ImportError('blocked for the test')\n")
    # Prepended, not replacing: MLX itself may come from PYTHONPATH (pip --target installs).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(blocker), os.environ.get("PYTHONPATH")) if p))
    out = run_script(1, "examples/compare_ddp_fsdp.py",
                     ["--steps", 2, "--out", tmp_path / "o", *TINY])
    assert "no plot: matplotlib is not installed" in out and "'.[plot]'" in out
    assert not (tmp_path / "o" / "compare.png").exists()
    with open(tmp_path / "o" / "compare.json") as f:
        res = json.load(f)
    assert len(res["fsdp"]["loss"]) == len(res["ddp_repeat"]["loss"]) == 2 and res["noise_floor"] == 0
    assert "DDP vs FSDP on 1 rank:" in out


def test_bench_step_sweep_two_ranks(tmp_path):
    out = run_script(2, "benchmarks/bench_step.py",
                     ["--hidden", 32, 48, "--layers", 2, "--steps", 2, "--warmup", 1,
                      "--communication-size", "1KiB", "32MiB", "--dtype", "float32", "bfloat16",
                      "--memory-limit", "1MiB",
                      "--json", tmp_path / "s.json", "--markdown", tmp_path / "s.md"])
    with open(tmp_path / "s.json") as f:
        res = json.load(f)
    assert res["world_size"] == 2 and res["reduce_scatter_method"] == "exchange"
    # The run records the memory limit it set, and the header says so.
    assert res["config"]["memory_limit"] == 1024**2 and "memory limit 1 MiB;" in out
    points = {(r["hidden"], r["dtype"], r["communication_size"]) for r in res["results"]}
    assert points == {(h, d, s) for h in (32, 48) for d in ("float32", "bfloat16")
                      for s in (1024, 32 * 1024**2)}
    for r in res["results"]:
        for mode in ("ddp", "fsdp"):
            assert r[mode]["step_ms_median"] > 0 and r[mode]["peak_mb"] > 0
        # (32 x 32 + 32) x 2 layers over 2 ranks divides evenly: exactly half.
        assert r["ratios"]["state_bytes"] == pytest.approx(0.5, abs=0.01)
    table = open(tmp_path / "s.md").read()
    assert table.count("\n| ") == 8 + 1 and "state FSDP/DDP" in table  # header + 8 rows
    # The row names the device the steps ran on (no --cpu: a GPU where there is one).
    assert f"| {res['results'][0]['device']} | MLP 2x48, batch 32 | 4.7k | bfloat16 | 1 KiB |" in out


def test_bench_step_times_the_example_gpt_the_update_hold_and_fully_sharded_rows(tmp_path):
    out = run_script(2, "benchmarks/bench_step.py",
                     ["--model", "gpt", "--dims", 16, "--heads", 2, "--layers", 1, "--seq-len", 8,
                      "--batch", 2, "--steps", 2, "--warmup", 1, "--communication-size", "32MiB",
                      "--dtype", "float32", "--cpu", "--json", tmp_path / "g.json",
                      "--modes", "ddp", "fsdp", "fully_shard", "ddp_checkpoint",
                      "--wrap", "root", "blocks", "reshard"])
    with open(tmp_path / "g.json") as f:
        res = json.load(f)
    assert res["world_size"] == 2 and res["device"].startswith("cpu")
    (row,) = res["results"]
    params = lm.num_params(lm.ByteGPT(16, 1, 2, 8))  # the example's GPT, not a stand-in
    assert (row["model"], row["dims"], row["heads"], row["seq_len"], row["batch"]) == ("gpt", 16, 2, 8, 2)
    assert row["device"] == "cpu" and row["num_params"] == params
    for mode in ("ddp", "fsdp"):
        r = row[mode]
        assert r["step_ms_median"] > 0 and r["peak_mb"] > 0 and r["state_mb"] > 0
        # opt.update's hold is part of the step it was timed in.
        assert 0 < r["update_ms_median"] <= r["step_ms_median"]
        assert len(r["rank0_update_ms"]) == len(r["rank0_step_ms"]) == 2
        assert all(0 < u <= t for u, t in zip(r["rank0_update_ms"], r["rank0_step_ms"]))
    assert row["ratios"]["update"] > 0
    assert row["ratios"]["state_bytes"] == pytest.approx(0.5, abs=0.02)
    # The forward and backward pass alone: a peak of its own, and the share of
    # the dropped state that shows in FSDP's peak, by its definition.
    assert row["grads_peak_mb"] > 0
    d, f = row["ddp"], row["fsdp"]
    assert row["ratios"]["peak_saved_per_state_dropped"] == pytest.approx(
        (d["peak_mb"] - f["peak_mb"]) / (d["state_mb"] - f["state_mb"]))
    header, _, rows = out.partition("| device | model |")
    assert "device cpu" in header and "DDP update ms | FSDP update ms" in rows
    assert "| grads-only peak MiB |" in rows and "| peak saved / state dropped |" in rows
    assert re.search(r"^\| cpu \| GPT 1x16, 2 heads, batch 2x8 \| [\d.]+k \| float32 \| 32 MiB \|"
                     r"( -?[\d.]+ \|){13}$", rows, re.M), out
    # Rank 0 shows its progress (steps and steps/s) on stderr, merged here.
    # 3 gradients-only steps, then 6 modes x (3 memory + 1 warm-up + 2 timed + 1 block-opening).
    assert re.search(r"\[1/1\] GPT 1x16.*: 45/45 steps, [\d.]+ steps/s", out), out
    # The fully sharded rows (whole model, per block, per block resharded) and DDP with
    # every block recomputed, timed with the others, in a second table.
    modes = ["ddp", "fsdp", "fully_shard", "fully_shard_blocks", "fully_shard_reshard",
             "ddp_checkpoint"]
    assert row["modes"] == modes
    for m in modes[2:]:
        r = row[m]
        assert r["step_ms_median"] > 0 and len(r["rank0_step_ms"]) == 2
        # The same steps on the same data as DDP: the same parameters, up to the
        # clipping norm's summation order (see the script's docstring).
        assert r["max_param_diff"] < 1e-3
        assert r["vs"]["time_vs_fsdp"] == pytest.approx(r["step_ms_median"] / f["step_ms_median"])
        assert r["vs"]["peak_vs_ddp"] == pytest.approx(r["peak_mb"] / d["peak_mb"])
    for m in modes[2:5]:  # parameters and state sharded: each rank holds about half
        assert row[m]["params_mb"] < 0.6 * d["params_mb"]
        assert row[m]["state_mb"] == pytest.approx(f["state_mb"], rel=0.02)
    assert row["ddp_checkpoint"]["params_mb"] == d["params_mb"] == f["params_mb"]
    table = out.partition("| mode | step ms | time / sharded step |")[2]
    for label in ("| DDP |", "| FSDP (sharded step) |", "| fully_shard, root |",
                  "| fully_shard, per block + root |", "| fully_shard, per block (reshard) + root |",
                  "| DDP + checkpoint per block |"):
        assert re.search(r"^\| cpu \| GPT 1x16, 2 heads, batch 2x8 \| [\d.]+k \| float32 \| 32 MiB "
                         + re.escape(label) + r"( -?[\d.e+-]+ \|){8}( - \|| [\d.e+-]+ \|)$",
                         table, re.M), (label, out)


def test_bench_collectives_two_ranks(tmp_path):
    run_script(2, "benchmarks/bench_collectives.py",
               ["--min-size", 4096, "--max-size", 65536, "--iters", 2, "--json", tmp_path / "c.json"])
    with open(tmp_path / "c.json") as f:
        res = json.load(f)
    assert res["world_size"] == 2 and res["reduce_scatter_method"] == "exchange"
    rows = res["results"]
    assert sorted({r["op"] for r in rows}) == ["all_gather", "all_sum", "reduce_scatter"]
    assert sorted({r["bytes"] for r in rows}) == [4096, 16384, 65536]
    assert all(r["ms"] > 0 and r["busbw_GBps"] > 0 for r in rows)


def ring_local(*command):
    """``benchmarks/ring_local.py`` on 2 ranks at a free port block, running ``command``."""
    from launch import _free_ports

    return [sys.executable, os.path.join(ROOT, "benchmarks", "ring_local.py"), "-n", "2",
            "--starting-port", str(_free_ports(2)), "--", sys.executable, *command]


def test_ring_local_starts_real_ring_ranks(tmp_path):
    # benchmarks/ring_local.py replaces mlx.launch for timing: the ranks it
    # starts must form one ring group of the asked size and finish cleanly.
    import subprocess

    out = tmp_path / "c.json"
    cmd = ring_local(os.path.join(ROOT, "benchmarks", "bench_collectives.py"),
                     "--min-size", "4096", "--max-size", "4096", "--iters", "2", "--json", str(out))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"HANG: {' '.join(cmd)} did not finish in 120s\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["reduce_scatter_method"] == "exchange"


def test_ring_local_stops_the_other_ranks_when_one_fails(tmp_path):
    # As mlx.launch does: rank 1 exits with 3 while rank 0 waits on
    # something that never ends; the job must end with rank 1's code.
    import subprocess
    import time

    script = tmp_path / "one_fails.py"
    script.write_text("import sys, mlx.core as mx\n"
                      "g = mx.distributed.init()\n"
                      "if g.rank() == 1:\n    sys.exit(3)\n"
                      "import time; time.sleep(600)\n")
    cmd = ring_local(str(script))
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"HANG: ring_local did not stop rank 0 after rank 1 failed\n{e.stderr}")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "ring_local: rank 1 exited with code 3; stopping the other ranks" in proc.stderr
    assert time.monotonic() - start < 30


def test_ring_local_keeps_each_ranks_lines_whole(tmp_path):
    # Unbuffered, print writes a line's text and its newline apart; two ranks
    # on one pipe then cut each other's lines (seen in the fault tests'
    # messages). Every line must come out whole.
    import subprocess

    script = tmp_path / "chatty.py"
    script.write_text("import os\nrank = os.environ['MLX_RANK']\n"
                      "for i in range(3000):\n    print(f'rank {rank} line {i} ' + 'x' * 40)\n")
    cmd = ring_local(str(script))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    expected = {f"rank {r} line {i} " + "x" * 40 for r in (0, 1) for i in range(3000)}
    assert len(lines) == len(expected) and set(lines) == expected


def test_ring_local_refuses_a_missing_command():
    import subprocess

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ring_local.py"), "-n", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "give -n >= 1 and a command after --" in proc.stderr


def test_bench_fully_parts_times_every_part_on_two_ranks():
    out = run_script(2, "benchmarks/bench_fully_parts.py",
                     ["--hidden", 32, "--layers", 2, "--batch", 2, "--iters", 2, "--warmup", 1])
    assert "N=2; MLP 2x32, batch 2 per rank; 2 rounds (ms)" in out
    for part in ("plain forward", "fully sharded forward", "gather", "plain forward+backward",
                 "fully sharded forward+backward", "sharded step", "fully sharded step"):
        assert re.search(rf"^{re.escape(part)} +median +[\d.]+ +min +[\d.]+$", out, re.M), out


def test_bench_pace_compares_both_settings_on_two_ranks():
    out = run_script(2, "benchmarks/bench_pace.py",
                     ["--hidden", 32, "--layers", 2, "--batch", 2, "--blocks", 2, "--block", 1])
    assert "N=2; MLP 2x32, batch 2 per rank; QUEUE_DEPTH 32 against 0" in out
    for mode in ("fsdp", "root", "blocks", "reshard"):
        assert re.search(rf"^{mode} +step ms +[\d.]+ -> +[\d.]+ \([\d.]+x\) +peak MiB +[\d.]+ -> +[\d.]+$",
                         out, re.M), out


def test_bench_summed_compares_both_settings_on_three_ranks():
    # One 1024 x 1024 layer: alone in its owner bucket at N=3, all-summed.
    out = run_script(3, "benchmarks/bench_summed.py",
                     ["--hidden", 1024, "--layers", 1, "--batch", 2, "--blocks", 1, "--block", 1])
    assert "N=3; MLP 1x1024, batch 2 per rank" in out
    for mode in ("fsdp", "fully"):
        m = re.search(rf"^{mode} +adafactor +step ms +[\d.]+ -> +[\d.]+ \([\d.]+x\) +peak MiB "
                      r"+([\d.]+) -> +([\d.]+)$", out, re.M)
        assert m and float(m[2]) < float(m[1]), out


def test_gpu_check_script_writes_each_part_within_its_budget(tmp_path):
    """benchmarks/gpu_check.sh, shrunk (SMALL=1) and on this machine's device:
    every part it runs on a lent GPU still runs (with mlx-lm, ACTS=1's too; the
    planner's recorded grid, RECORD=1), and a test file it is given reports its
    own summary."""
    import importlib.util
    import subprocess

    acts = importlib.util.find_spec("mlx_lm") is not None  # the `lm` extra
    # Every switch named: a run inside gpu_check.sh itself (BENCH=0) must not skip parts here.
    env = dict(os.environ, SMALL="1", ACTS=str(int(acts)), BENCH="1", PLANNER="0", JOBS="1",
               RECORD="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    cmd = ["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), str(tmp_path), "150", "-",
           "test_fused.py"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"HANG: {' '.join(cmd)} did not finish in 200s\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = (tmp_path / "step.txt").read_text()
    for row in ("fully_shard, root", "fully_shard, per block (reshard) + root",
                "DDP + checkpoint per block"):
        assert step.count(f"| {row} |") == 2, step  # the GPT's table and the MLP's
    assert (tmp_path / "step_gpt.md").exists() and (tmp_path / "step_mlp.md").exists()
    assert re.search(r"\b\d+ passed in ", (tmp_path / "suite.txt").read_text()), tmp_path
    assert not (tmp_path / "yard.txt").exists()  # "-" skips the yardstick
    planner = (tmp_path / "planner.txt").read_text()  # RECORD=1: the grid's table and records
    assert "predicted / measured: lowest" in planner, planner
    records = [json.loads(line) for line in planner.splitlines() if line.startswith("{")]
    assert len(records) == 8 and all(len(r["measured"]) == 2 for r in records), planner
    if acts:  # the activations alone, then a fully sharded Llama step, each against the plan
        assert (tmp_path / "acts.txt").read_text().count("predicted / measured: lowest") == 2
