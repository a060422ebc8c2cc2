"""scripts/bench.py runs on the CPU on the embedded checkpoint, and what it reports holds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_profile_counts_fewer_operations_compiled(bench):
    res = bench.bench_profile(None, steps=1)
    compiled, plain = res["compiled"], res["uncompiled"]
    assert len(compiled["ops_per_layer"]) == len(res["layers"]) == len(compiled["layer_ms"])
    assert all(n > 0 for n in compiled["ops_per_layer"])
    assert compiled["ops_total"] < plain["ops_total"]


def test_e2e_drafted_replies_equal_undrafted_and_mlxlm_runs_beside(bench):
    from dsv41_mlx.tiny import default_checkpoint

    res = bench.bench_e2e(str(default_checkpoint()), n_prompts=1, tokens=3, oracle_rate=0.56)
    runs = res["runs"]
    assert runs["drafted greedy"]["hash"] == runs["plain greedy"]["hash"]
    assert runs["drafted coupled"]["hash"] == runs["plain coupled"]["hash"]
    assert runs["oracle 0.56 greedy"]["hash"] == runs["plain greedy"]["hash"]
    assert res["mlxlm"]["decode_tok_s"] > 0 and res["prefill_tok_s"] > 0 and res["prefill_seen_tok_s"] > 0
    assert res["warm_up_s"] > 0


def test_warm_up_prompt_takes_every_chunk_path(bench, fixture_model):
    """The e2e warm-up prompt prefills a first chunk, a full chunk on a cache already holding
    more than a window, and a shorter last chunk that gets padded."""
    from dsv41_mlx.generate import PREFILL_ROUND

    for chunk in (32, 256):
        ids = bench.warm_up_prompt(fixture_model, chunk)
        chunks = [ids[i: i + chunk] for i in range(0, len(ids), chunk)]
        assert [len(c) for c in chunks[:-1]] == [chunk, chunk] and chunk > fixture_model.args.sliding_window
        assert 0 < len(chunks[-1]) < chunk and len(chunks[-1]) % PREFILL_ROUND
        assert all(0 <= t < fixture_model.args.vocab_size for t in ids)


def test_count_ops_counts_the_gpu_path_with_its_kernels():
    """scripts/count_ops.py builds a decode step as a GPU runs it (the custom kernels stubbed,
    one operation each) on the CPU: every layer's attention through the attention kernel,
    every MoE through the router kernels, and nothing of the patch left behind."""
    from dsv41_mlx import kernels
    from dsv41_mlx.tiny import default_checkpoint

    spec = importlib.util.spec_from_file_location("count_ops", SCRIPT.parent / "count_ops.py")
    count_ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(count_ops)
    res = count_ops.count(str(default_checkpoint()), rows=8, prompt=40)
    layers = sum(len(v) for v in res["per_kind"].values())
    calls = res["kernel_calls"]
    assert calls["sparse_attention"] == calls["moe_gate_scores"] == calls["moe_gate_topk"] == layers
    assert calls["hc_input"] == 2 * layers
    assert 0 < res["total"] < 200 * layers
    assert kernels.backend() == "mlx" and kernels.device_backend() == "mlx"
