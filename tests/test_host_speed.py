"""scripts/host_speed.py: its split of steps, and a short run on the embedded tiny checkpoint."""

from __future__ import annotations

import subprocess
import sys

from .scripts import SCRIPTS, load_script

SCRIPT = SCRIPTS / "host_speed.py"


def test_slow_steps_are_over_a_fifth_above_the_fast_quarter():
    host_speed = load_script("host_speed")
    rows = [{"step_ms": ms} for ms in (40, 41, 42, 43, 50, 51, 60, 62)]
    groups = host_speed.split(rows)  # the fastest quarter's slowest: 41 ms, so slow is over 49.2
    assert [r["step_ms"] for r in groups["fast"]] == [40, 41, 42, 43]
    assert [r["step_ms"] for r in groups["slow"]] == [50, 51, 60, 62]


def test_it_runs_and_restores_async_eval():
    """A fresh process, its blocks evaluated on the evaluator's thread (the GPU's default; here
    its first forward found arrays of the main thread's stream once), under cProfile, without
    the warm-up (a minute on this CPU)."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--steps", "6", "--profile", "5", "--thread", "on",
                          "--no-warm-up"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "| fast |" in out.stdout and "steps in order, ms:" in out.stdout
    assert "blocks evaluated on the evaluator's thread" in out.stdout and "| - |" in out.stdout  # no Python column
    # the profile's table: its top functions, the model's forward among the calls it saw
    assert "cProfile over all 6 steps" in out.stdout and "Ordered by: internal time" in out.stdout
    assert "dsv41_mlx/models/" in out.stdout
    host_speed = load_script("host_speed")
    import mlx.core as mx

    real, total = mx.async_eval, [0.0]
    with host_speed.timed_async_eval(total):
        a = mx.array(2.0) + 1
        mx.async_eval(a)
    assert total[0] > 0 and mx.async_eval is real and a.item() == 3.0
