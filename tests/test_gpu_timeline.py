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
    # the waits over 50 us, by the kernel after them: a_1 after 100 us in each step, a_1 after 870 between
    assert res["gaps"] == [{"kernel": "a_1", "gaps_per_step": 1.5, "idle_ms_per_step": pytest.approx((100 + 870 / 2) / 1e3)}]
    assert timeline.summarize([], steps=3)["busy_ms"] == 0


def test_refuses_off_cuda_with_a_message():
    out = subprocess.run([sys.executable, str(SCRIPT), "--model", "unused"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "needs MLX on CUDA" in out.stderr and "Traceback" not in out.stderr


def test_a_steps_kernels_listed_in_order(timeline):
    kernels = [(30, 35, "void mlx::core::cu::copy_v<float>(float*)"), (0, 10, "custom_kernel_hc_mix_1(float*)"),
               (8, 20, "gather"), (100, 110, "custom_kernel_hc_mix_1(float*)"), (112, 120, "gather"),
               (130, 135, "void mlx::core::cu::copy_v<float>(float*)")]
    # (start from the step's first kernel, us, idle before it, name): gather overlaps hc_mix, copy_v waits 10 us
    assert timeline.step_kernels(kernels, 2) == [(0, 10, 0, "hc_mix_1"), (8, 12, 0, "gather"), (30, 5, 10, "copy_v")]
    assert timeline.step_kernels(kernels, 2, 1) == [(0, 10, 0, "hc_mix_1"), (12, 8, 2, "gather"),
                                                    (30, 5, 10, "copy_v")]


def test_one_row_steps_run_as_generate_runs_them(timeline, fixture_dir, monkeypatch):
    """load_warm's one-row step: the greedy tokens generate_step hands out, each forward begun
    before its token is read back (decode_ahead, the token drawn on the forwards' stream),
    one position a step."""
    import dsv41_mlx
    from dsv41_mlx.generate import generate_step
    from dsv41_mlx.runtime.runner import Runner
    from dsv41_mlx.sampling import SamplingParams

    model, _ = dsv41_mlx.load(fixture_dir)
    prompt = timeline.prompt_of(12, model.args.vocab_size)
    with Runner(model) as runner:
        expected = list(generate_step(runner, prompt, SamplingParams(), 8))
    seen = []
    real_decode_ahead = Runner.decode_ahead

    def spy(self, token, cache, on_forward_stream=False):
        seen.append((int(token.item()), cache.offset, on_forward_stream))
        return real_decode_ahead(self, token, cache, on_forward_stream)

    monkeypatch.setattr(Runner, "decode_ahead", spy)
    with timeline.load_warm(str(fixture_dir), 1, len(prompt)) as step:
        for _ in range(3):
            step()
    assert [t for t, _, _ in seen] == expected[: len(seen)] and len(seen) == 8  # the first, 4 untimed, 3 steps
    assert [offset for _, offset, _ in seen] == list(range(len(prompt), len(prompt) + 8))
    assert all(queued for _, _, queued in seen)  # each token drawn on the forwards' stream, as generate_step's


def test_prefill_steps_prefill_the_prompt_into_an_empty_cache(timeline, fixture_dir, monkeypatch):
    """load_warm with prefill_only: each step one prefill of the whole prompt into a fresh cache
    (two untimed first), the logits generate.prefill gives."""
    import dsv41_mlx
    import mlx.core as mx
    from dsv41_mlx.generate import prefill
    from dsv41_mlx.runtime.runner import Runner

    model, _ = dsv41_mlx.load(fixture_dir)
    prompt = timeline.prompt_of(20, model.args.vocab_size)
    with Runner(model) as runner:
        expected, _ = prefill(runner, prompt, runner.make_cache())
    calls, outs = [], []

    def spy(runner, ids, cache, *args, **kw):
        calls.append((list(ids), cache.offset))
        logits, features = prefill(runner, ids, cache, *args, **kw)
        outs.append(logits)
        return logits, features

    monkeypatch.setattr(sys.modules["dsv41_mlx.generate"], "prefill", spy)
    with timeline.load_warm(str(fixture_dir), 1, len(prompt), prefill_only=True) as step:
        assert len(calls) == 2  # the two untimed prefills
        step()
        step()
    assert calls == [(prompt, 0)] * 4  # the whole prompt, an empty cache each time
    for logits in outs:
        assert mx.array_equal(logits, expected)


NCU_CSV = '''==PROF== Connected to process 571 (/usr/bin/python3.12)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","571","python3.12","127.0.0.1","mlx::core::cu::custom_kernel_hc_mix_1(float const*)","1","7","(256, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","11,200"
"1","571","python3.12","127.0.0.1","void mlx::core::cu::copy_v<float, float, unsigned int, 4>(float const*, float*)","1","7","(256, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","us","2.5"
"1","571","python3.12","127.0.0.1","void mlx::core::cu::copy_v<float, float, unsigned int, 4>(float const*, float*)","1","7","(256, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","4,096"
"2","571","python3.12","127.0.0.1","mlx::core::cu::custom_kernel_hc_mix_1(float const*)","1","7","(256, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ms","0.0088"
==PROF== Disconnected from process 571
'''


def test_ncu_table_read_in_its_units(timeline):
    kernels = timeline.ncu_kernels(NCU_CSV)
    assert [timeline.short_name(name) for _, _, name in kernels] == ["hc_mix_1", "copy_v", "hc_mix_1"]
    assert [round(end - start, 6) for start, end, _ in kernels] == [11.2, 2.5, 8.8]  # us; the bytes row left out
    assert kernels[1][0] == pytest.approx(11.2) and kernels[2][0] == pytest.approx(13.7)  # end to end
    res = timeline.summarize(kernels, 1)
    assert res["busy_ms"] == pytest.approx(22.5 / 1e3) and res["long_gaps_ms"] == 0
    assert (res["table"][0]["kernel"], res["table"][0]["calls_per_step"], res["table"][0]["us_per_call"]) == \
        ("hc_mix_1", 2, pytest.approx(10.0))


def test_ncu_table_errors_name_the_problem(timeline):
    with pytest.raises(ValueError, match="no ncu table"):
        timeline.ncu_kernels("==PROF== nothing profiled\n")
    with pytest.raises(ValueError, match="'cycle'"):
        timeline.ncu_kernels(NCU_CSV.replace('"ns","11,200"', '"cycle","11,200"'))


def test_ncu_csv_from_the_command_line(tmp_path):
    path = tmp_path / "times.csv"
    path.write_text(NCU_CSV)
    out = subprocess.run([sys.executable, str(SCRIPT), "--ncu-csv", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "kernel time summed 0.02 ms, 3 kernels" in out.stdout
    assert "| hc_mix_1 | 2.0 | 10.0 | 0.020 |" in out.stdout
    out = subprocess.run([sys.executable, str(SCRIPT), "--ncu-csv", str(tmp_path / "missing.csv")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "missing.csv" in out.stderr and "Traceback" not in out.stderr


def test_propose_steps_propose_from_the_prompts_rings(timeline, fixture_dir, monkeypatch):
    """load_warm with propose_only: the prompt's features in the drafter's rings, each step one
    greedy proposal from the prompt's next token (four untimed first), evaluated; the same
    drafts as a drafter given that prompt directly."""
    import dsv41_mlx
    import mlx.core as mx
    from dsv41_mlx.generate import prefill
    from dsv41_mlx.runtime.drafter import Drafter
    from dsv41_mlx.runtime.runner import Runner

    model, _ = dsv41_mlx.load(fixture_dir)
    prompt = timeline.prompt_of(20, model.args.vocab_size)
    with Runner(model) as runner:
        drafter = runner.drafter
        logits, features = prefill(runner, prompt, runner.make_cache(), keep_features=drafter.window)
    rings = drafter.make_cache()
    rings.end = len(prompt) - features.shape[0]
    drafter.ingest(rings, features)
    expected = drafter.propose(rings, int(mx.argmax(logits).item())).drafts.tolist()
    seen = []
    real_propose = Drafter.propose

    def spy(self, cache, anchor, *args):
        proposal = real_propose(self, cache, anchor, *args)
        seen.append((anchor, cache.end, proposal))
        return proposal

    monkeypatch.setattr(Drafter, "propose", spy)
    with timeline.load_warm(str(fixture_dir), 1, len(prompt), propose_only=True) as step:
        step()
    assert len(seen) == 5 and {(a, end) for a, end, _ in seen} == {(int(mx.argmax(logits).item()), len(prompt))}
    assert all(p.drafts.tolist() == expected for _, _, p in seen)


def test_propose_needs_a_checkpoint_with_drafter_stages(timeline, fixture_dir, monkeypatch):
    import dsv41_mlx

    real_load = dsv41_mlx.load

    def without_drafter(path):
        model, tok = real_load(path)
        model.mtp = []
        return model, tok

    monkeypatch.setattr(dsv41_mlx, "load", without_drafter)
    with pytest.raises(SystemExit, match="no DSpark stages"):
        with timeline.load_warm(str(fixture_dir), 1, 12, propose_only=True):
            pass


@pytest.mark.parametrize("modes", [("--prefill", "--propose"), ("--propose", "--oracle"), ("--prefill", "--oracle")])
def test_refuses_two_modes_together(modes):
    out = subprocess.run([sys.executable, str(SCRIPT), "--model", "unused", *modes], capture_output=True, text=True)
    assert out.returncode == 2 and "give one" in out.stderr and "Traceback" not in out.stderr


def test_rounds_cut_at_each_verify_forwards_head(timeline):
    """Two heads make one round: from the first head's end (100 us) the verdict's sample, an
    idle 400 us, the ingest ending in its ring write, idle 300 us, then the forward (two
    kernels, 50 us idle between them) to the next head's end."""
    k = "mlx::core::cu::custom_kernel_{}(float const*)"
    kernels = [(0, 100, k.format("head_logits_8")), (100, 110, "void arg_reduce<float>(float const*)"),
               (510, 530, k.format("act_quant_fp8_bfloat16_t")), (530, 540, k.format("ring_write_3_128")),
               (840, 900, k.format("hc_input_5120_4_20")), (950, 1000, k.format("fp4_experts_1_0_2_0_2_1")),
               (1000, 1100, k.format("head_logits_8")), (1100, 1110, "void arg_reduce<float>(float const*)")]
    (r,) = timeline.round_summary(kernels)
    assert r["round_ms"] == pytest.approx(1.0) and r["busy_ms"] == pytest.approx((10 + 30 + 60 + 150) / 1e3)
    assert r["boundary_ms"] == pytest.approx(0.74) and r["forward_ms"] == pytest.approx(0.26)
    assert r["forward_busy_ms"] == pytest.approx(0.21) and r["kernels"] == 6
    assert r["gaps"] == [(410, 400, "act_quant_fp8_bfloat16_t"), (740, 300, "hc_input_5120_4_20"),
                         (850, 50, "fp4_experts_1_0_2_0_2_1")]
    assert timeline.round_summary(kernels[:2]) == []  # one head: no whole round


def test_oracle_rounds_regenerate_the_plain_reply(timeline, fixture_dir):
    """load_oracle: the prompt's plain greedy reply, then a generation drafted by the
    benchmarks' oracle drafter that must give it again; every draft verified."""
    from scripts.benchmarks.harness import OracleDrafter

    with timeline.load_oracle(str(fixture_dir), 20, 12) as generate:
        decoder = generate()
    assert isinstance(decoder.drafter, OracleDrafter) and decoder.policy.mode == "off"
    stats = decoder.stats
    assert stats.rounds > 1 and 0 < stats.accepted <= stats.verified  # the reply's own tokens, 0.56 of them right


def test_rounds_report_takes_medians_beside_the_hosts_round(timeline):
    """Six rounds: the first and last two left out, the medians of the middle two; the host's
    round from the decoder's stats; the middle round's stretches listed; none without rounds."""
    from dsv41_mlx.speculative import DraftStats

    def one(ms, gap):
        return {"round_ms": ms, "busy_ms": ms - 4, "boundary_ms": 2.0, "forward_ms": ms - 2, "forward_busy_ms": ms - 5,
                "kernels": 800, "gaps": [(100.0, gap, "gather"), (900.0, 500.0, "hc_input_5120")]}

    rounds = [one(40, 9000), one(50, 9000), one(27, 1000), one(29, 3000), one(60, 9000), one(70, 9000)]
    stats = DraftStats(block=5, rounds=4, propose_s=0.002, verify_s=0.1, ingest_s=0.002)
    text, figures = timeline.rounds_report(rounds, stats, 261)
    assert figures["medians"]["round_ms"] == pytest.approx(28) and figures["idle_ms"] == pytest.approx(2.5)
    assert figures["host_ms_per_round"] == pytest.approx(26)
    assert "26.00 ms a round on the host" in text and "| 100 | 3000 | gather |" in text  # rounds 2, 3: the middle is 3
    assert timeline.rounds_report([], stats, 261) is None


def test_profiled_forwards_run_without_the_rows_gate(timeline, fixture_model, monkeypatch):
    """Under the profiler a gated forward never saw the host's release: the timeline's runner takes
    the device's options but for the gate."""
    from dsv41_mlx.runtime import options

    gpu_like = options.Options(decode_rows=8, build_ahead=True, evaluate_on_thread=True, gate_rows=True)
    monkeypatch.setattr(options, "default_options", lambda args, device=None: gpu_like)
    with timeline.profiled_runner(fixture_model) as runner:
        assert runner.options == options.Options(decode_rows=8, build_ahead=True, evaluate_on_thread=True,
                                                 gate_rows=False)


def test_several_contexts_run_in_one_process_each_after_its_own_prompt(timeline, fixture_dir, monkeypatch):
    """record over contexts 12 and 30: the model loads once, and each context's steps run after a
    prompt of that length (a fresh cache: its first step's forward at that offset)."""
    import dsv41_mlx
    from dsv41_mlx.runtime.runner import Runner

    loads, offsets = [], []
    real_load, real_decode_ahead = dsv41_mlx.load, Runner.decode_ahead
    monkeypatch.setattr(dsv41_mlx, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))

    def spy(self, token, cache, on_forward_stream=False):
        offsets.append(cache.offset)
        return real_decode_ahead(self, token, cache, on_forward_stream)

    monkeypatch.setattr(Runner, "decode_ahead", spy)
    monkeypatch.setattr(timeline, "profiled", lambda run: ([(0.0, 1.0, f"k{len(offsets)}")], run(), 0.5))
    results = timeline.record(str(fixture_dir), 1, 2, [12, 30])
    assert len(loads) == 1
    # each context: its first forward, 4 untimed steps, 2 profiled ones
    assert offsets == list(range(12, 12 + 7)) + list(range(30, 30 + 7))
    # (the profiler started after each context's 5 untimed forwards; the wall is per step)
    assert [wall for _, wall in results] == [0.25, 0.25] and [k[0][2] for k, _ in results] == ["k5", "k12"]


def test_growth_lists_what_the_longer_context_adds(timeline):
    """Each kernel's ms a step at both contexts, the most grown first, one only in either counted
    at 0 in the other."""
    first = timeline.summarize([(0, 100, "sort"), (100, 300, "gemv"), (300, 350, "copy_v")], 1)
    last = timeline.summarize([(0, 900, "sort"), (900, 1100, "gemv"), (1100, 1200, "gather")], 1)
    grown = timeline.growth(first, last)
    assert [row["kernel"] for row in grown] == ["sort", "gather", "gemv", "copy_v"]
    assert [round(row["grew_ms"], 3) for row in grown] == [0.8, 0.1, 0.0, -0.05]
    assert grown[1]["calls_first"] == 0 and grown[1]["calls_last"] == 1
    # the waits before each kernel: gather waited 400 us at the longer context, gemv 100 us at both
    first = timeline.summarize([(0, 100, "sort"), (200, 300, "gemv")], 1)
    last = timeline.summarize([(0, 100, "sort"), (200, 300, "gemv"), (700, 800, "gather")], 1)
    waited = timeline.growth(first, last, "gaps")
    assert [(row["kernel"], round(row["grew_ms"], 3)) for row in waited] == [("gather", 0.4), ("gemv", 0.0)]
