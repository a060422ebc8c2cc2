"""scripts/gpu_timeline.py: its arithmetic on made-up kernel timings, and its refusal off CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .scripts import SCRIPTS, load_script

SCRIPT = SCRIPTS / "gpu_timeline.py"


@pytest.fixture(scope="module")
def timeline():
    return load_script("gpu_timeline")


def test_short_names(timeline):
    assert timeline.short_name("mlx::core::cu::custom_kernel_hc_mix_5120_4_16(__nv_bfloat16 const*, float const*)") \
        == "hc_mix_5120_4_16"
    assert timeline.short_name("void mlx::core::cu::copy_v<__nv_bfloat16, float, unsigned int, 8>(__nv_bfloat16 "
                               "const*, float*, unsigned int)") == "copy_v"
    assert timeline.short_name("void sgemm_largek_lds64<true, false, 6>(float*, float const*)") == "sgemm_largek_lds64"
    assert timeline.short_name("Memcpy DtoD (Device -> Managed)") == "Memcpy DtoD"


def test_busy_time_counts_overlaps_once(timeline):
    assert timeline.busy_time([]) == 0
    assert timeline.busy_time([(0, 10), (5, 12), (20, 25)]) == 17
    assert timeline.busy_time([(20, 25), (0, 10), (2, 3)]) == 15


def test_summary_per_step(timeline):
    # two steps, each: kernel a 0-10 us, kernel b 8-20 (overlapping a), then an idle 100 us, kernel a again 10 us
    kernels = []
    for base in (0, 1000):
        kernels += [(base, base + 10, "custom_kernel_a_1(int)"), (base + 8, base + 20, "void b<int>(int)"),
                    (base + 120, base + 130, "custom_kernel_a_1(int)")]
    res = timeline.summarize(kernels, steps=2)
    assert res["kernels_per_step"] == 3
    assert res["busy_ms"] == pytest.approx(30 / 1e3)  # 0-20 and 120-130
    assert res["kernel_sum_ms"] == pytest.approx(32 / 1e3)
    assert res["long_gaps_ms"] == pytest.approx((100 + 870 / 2) / 1e3)  # 100 in each step, 870 between them
    assert res["span_ms"] == pytest.approx(1130 / 2 / 1e3)
    top = res["table"][0]
    assert (top["kernel"], top["calls_per_step"], top["us_per_call"]) == ("a_1", 2, 10)
    assert res["table"][1]["kernel"] == "b"
    assert timeline.summarize([], steps=3)["busy_ms"] == 0


def test_refuses_off_cuda_with_a_message():
    out = subprocess.run([sys.executable, str(SCRIPT), "--model", "unused"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "needs MLX on CUDA" in out.stderr and "Traceback" not in out.stderr


def test_first_step_lists_its_kernels_in_order(timeline):
    kernels = [(30, 35, "void mlx::core::cu::copy_v<float>(float*)"), (0, 10, "custom_kernel_hc_mix_1(float*)"),
               (12, 20, "gather"), (100, 110, "custom_kernel_hc_mix_1(float*)"), (112, 120, "gather"),
               (130, 135, "void mlx::core::cu::copy_v<float>(float*)")]
    assert timeline.first_step(kernels, 2) == [(10, "hc_mix_1"), (8, "gather"), (5, "copy_v")]
