"""`bench.py context` on the fixture: its rows, where it stops, and the decode floor's bytes."""

from __future__ import annotations

import pytest

from scripts.benchmarks import context


def test_step_reads_the_window_and_the_picked_groups(fixture_model):
    """Four tokens into the fixture (window 8, ratios 0,0,2,2,2,1,1,1, index_topk 4): every layer
    reads its 4 window keys (bf16, 64 wide), each ratio-2 layer its 2 groups, each ratio-1 layer
    its 4; no indexer scores yet (no layer has more groups than it picks)."""
    assert context.step_read_bytes(fixture_model, 4) == 8 * 4 * 128 + 3 * 2 * 128 + 3 * 4 * 128
    assert context.step_read_bytes(fixture_model, 60) > context.step_read_bytes(fixture_model, 30)


def test_context_rows_compare_the_elided_prefill_with_the_full_one(fixture_dir, capsys, monkeypatch):
    monkeypatch.setattr(context, "copy_bandwidth", lambda: 100e9)  # (measuring it copies GBs: slow on a CPU)
    res = context.bench_context(str(fixture_dir), [16, 40, 100], tokens=3, mlxlm=False, warm=False)
    short, long, past = res["rows"]
    for row in (short, long):
        assert row["elided"]["first_two"] == row["full"]["first_two"]  # the same first tokens
        assert row["elided"]["cache_bytes_per_token"] > 0
        assert row["floor_tok_s"] == pytest.approx(100e9 / (row["step_GB"] * 1e9))
    assert "past the model's context of 64 tokens" in past["skipped"]
    context.print_context({"date": "d", "device": "cpu", "backend": "mlx", "mlx": "0", "commit": "c"}, res)
    assert "| 100 | past the model's context of 64 tokens |" in capsys.readouterr().out


def test_long_contexts_are_warmed_up_untimed_past_the_kernels_long_prompts_add(fixture_dir, fixture_model,
                                                                                 monkeypatch):
    """Before the timed rows, a prompt past the candidate source's blocks and one block of MLX's
    sort (long_warm_length; the release's: 16,448 tokens), or the longest context asked for,
    runs untimed each way a row prefills, so that no row's prefill holds MLX's kernel builds
    for the long shapes; none where every context is as short as the shortest."""
    import importlib

    generate = importlib.import_module("dsv41_mlx.generate")  # (the package's `generate` is the function)
    args = fixture_model.args  # candidates: 2 blocks of 4 at ratio 1; index sources at ratios 2 and 1
    assert context.long_warm_length(args) == max(2 * 4 + 64, 4096 * 2 + 64)
    monkeypatch.setattr(context, "copy_bandwidth", lambda: 100e9)
    monkeypatch.setattr(generate, "warm_up", lambda runner: 0.0)
    calls, run = [], context._generate
    monkeypatch.setattr(context, "_generate", lambda runner, prompt, tokens: (
        calls.append((len(prompt), tokens, runner.options.elide_prefill)), run(runner, prompt, tokens))[1])
    res = context.bench_context(str(fixture_dir), [16, 40, 100], tokens=3, mlxlm=False)  # 100: past the model's 64
    assert calls[:2] == [(40, 2, True), (40, 2, False)]  # the warm-ups at the longest that runs, then the rows
    assert calls[2:] == [(16, 3, True), (16, 2, False), (40, 3, True), (40, 2, False)]
    assert res["long_warm_up"]["tokens"] == 40 and "skipped" in res["rows"][2]
    calls.clear()
    res = context.bench_context(str(fixture_dir), [40], tokens=3, mlxlm=False, full=False)
    assert calls == [(40, 3, True)] and "long_warm_up" not in res

    def failing_without_elision(runner, prompt, tokens):  # as a card short of memory may
        if not runner.options.elide_prefill:
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        return run(runner, prompt, tokens)

    monkeypatch.setattr(context, "_generate", failing_without_elision)
    res = context.bench_context(str(fixture_dir), [16, 40], tokens=3, mlxlm=False)
    assert "out of memory" in res["long_warm_up"]["full_stopped"]  # said, and the rows still run
    assert [("elided" in r, "full_stopped" in r) for r in res["rows"]] == [(True, True), (True, True)]


def test_a_run_out_of_memory_is_said_in_its_column(fixture_dir, capsys, monkeypatch):
    """The full prefill failing at a context (as a card's memory may) keeps the elided run's
    row and says why in the full run's column."""
    monkeypatch.setattr(context, "copy_bandwidth", lambda: 100e9)
    generate = context._generate

    def failing_without_elision(runner, prompt, tokens):
        if not runner.options.elide_prefill:
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        return generate(runner, prompt, tokens)

    monkeypatch.setattr(context, "_generate", failing_without_elision)
    res = context.bench_context(str(fixture_dir), [40], tokens=3, mlxlm=False, warm=False)
    (row,) = res["rows"]
    assert row["elided"]["decode_tok_s"] > 0 and "full" not in row and row["floor_tok_s"] > 0
    context.print_context({"date": "d", "device": "cpu", "backend": "mlx", "mlx": "0", "commit": "c"}, res)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| 40 |"))
    assert line.split(" | ")[2] == "RuntimeError: cudaMallocAsync(&data, size, stream) failed: out of memory"
