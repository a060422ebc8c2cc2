"""scripts/bench.py prefix: a chat's second turn resumed from the prefix cache, on the embedded
checkpoint on the CPU, where the resumed reply must be the whole prefill's, bit for bit."""

from __future__ import annotations

import mlx.core as mx

from scripts.benchmarks import prefix


def test_a_resumed_second_turn_matches_the_whole_prefill_and_says_so(capsys):
    res = prefix.bench_prefix(None, 300, 4, 1)
    assert 300 <= res["first_prompt_tokens"] < res["cached_tokens"][0] < res["second_prompt_tokens"]
    assert res["replies_equal"] and res["cold_replies_agree"] and res["resumed_replies_agree"]
    assert res["first_difference"] is None and res["logits_max_difference"] == 0.0
    assert res["top_two_gap"] > 0 and res["entry_bytes"] > 0
    prefix.print_prefix({"date": "d", "device": "cpu", "backend": "cpu", "mlx": "0", "commit": "c"}, res, "tiny")
    out = capsys.readouterr().out
    assert "| yes |" in out and "differ by up to" not in out


def test_replies_that_part_say_where_and_by_how_much_the_logits_differ(capsys):
    cold_logits = mx.array([0.0, 2.0, 1.5, -1.0])
    res = prefix.compare_replies([5, 6, 7, 8], [5, 6, 9, 8], cold_logits, cold_logits + mx.array([0, 0, 0.25, 0]))
    assert res == {"first_difference": 2, "logits_max_difference": 0.25, "top_two_gap": 0.5}
    assert prefix.compare_replies([5, 6], [5, 6, 7], cold_logits, cold_logits)["first_difference"] == 2
    assert prefix.compare_replies([5, 6], [5, 6], cold_logits, cold_logits)["first_difference"] is None

    shown = {"context": 4096, "asked_prefix_tokens": 300, "limited": False, "first_prompt_tokens": 310,
             "second_prompt_tokens": 340, "cached_tokens": [325], "first_turn_ttft_s": 1.0, "cold_ttft_s": 0.5,
             "resumed_ttft_s": 0.05, "speedup": 10.0, "entry_bytes": 1e6, "replies_equal": False,
             "cold_replies_agree": True, "resumed_replies_agree": True, **res, "repeats": 1}
    prefix.print_prefix({"date": "d", "device": "gpu", "backend": "cuda", "mlx": "0", "commit": "c"}, shown, "x")
    out = capsys.readouterr().out
    assert "| NO |" in out and "first differs from the whole one at token 2" in out
    assert "differ by up to 0.25 (the whole prefill's two best are 0.5 apart)" in out
