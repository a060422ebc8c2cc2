"""scripts/bench.py's benchmarks (scripts/benchmarks/) run on the CPU on the embedded checkpoint,
and what they report holds."""

from __future__ import annotations

import contextlib
import importlib
import re
import statistics
import sys

import mlx.core as mx
import pytest

from scripts.benchmarks import e2e, gemms, harness, layouts, profile, propose, steps

from .scripts import SCRIPTS, load_script


def test_profile_counts_fewer_operations_compiled():
    res = profile.bench_profile(None, steps=1)
    compiled, plain = res["compiled"], res["uncompiled"]
    assert len(compiled["ops_per_layer"]) == len(res["layers"]) == len(compiled["layer_ms"])
    assert all(n > 0 for n in compiled["ops_per_layer"])
    assert compiled["ops_total"] < plain["ops_total"]


def _short_prompts(monkeypatch, benchmark) -> None:
    """A benchmark's prompts (scripts/prompts.json's) cut to their first 24 words: the same
    tables and reply checks, on prefills a CPU runs in a fraction of the time (ours and mlx-lm's)."""
    texts = harness.prompt_texts
    monkeypatch.setattr(benchmark, "prompt_texts", lambda n: [" ".join(t.split()[:24]) for t in texts(n)])


def test_e2e_drafted_replies_equal_undrafted_and_mlxlm_runs_beside(monkeypatch, capsys):
    from dsv41_mlx.io.tiny import default_checkpoint

    generate = importlib.import_module("dsv41_mlx.generate")  # (the package's `generate` is the function)
    order, warm_up = [], generate.warm_up  # the floor's bandwidth measured once the warm-up has run
    # (the warm-up of every chunk shape has a test of its own: here chunks of one padded row count)
    monkeypatch.setattr(generate, "warm_up",
                        lambda runner: order.append("warm-up") or warm_up(runner, chunk=generate.PREFILL_ROUND))
    # (the real measurement has a test of its own; three of 1 GiB copies take ~1.5 min on a CI core)
    monkeypatch.setattr(e2e, "copy_bandwidth", lambda: order.append("bandwidth") or 2e11)
    _short_prompts(monkeypatch, e2e)
    reported = []  # what is handed over before the paired measurement, the slowest and last part
    sequences, make_oracle = [], harness.OracleDecoders.__call__  # what each oracle knows
    monkeypatch.setattr(harness.OracleDecoders, "__call__",
                        lambda self, params, sequence, **kw: sequences.append(tuple(sequence))
                        or make_oracle(self, params, sequence, **kw))
    res = e2e.bench_e2e(str(default_checkpoint()), n_prompts=1, tokens=3, oracle_rate=0.56, report=reported.append)
    # every oracle, each row's warm-up's too, knows the reply it drafts for: two prompts, two sequences
    assert len(sequences) > 4 and len(set(sequences)) == 2
    assert order == ["warm-up", "bandwidth"] and res["copy_GBps"] == 200
    assert res["floor_ms"] == pytest.approx(res["bytes_per_token_GB"] / 200 * 1e3)
    assert len(reported) == 1 and reported[0]["runs"] == res["runs"]
    assert reported[0]["paired"] == {"skipped": e2e.PAIRED_LATER}
    runs = res["runs"]
    assert runs["drafted greedy"]["hash"] == runs["plain greedy"]["hash"]
    assert runs["drafted coupled"]["hash"] == runs["plain coupled"]["hash"]
    every = runs["drafted greedy, every draft verified"]  # a round at every step: the propose pass in the loop
    assert every["hash"] == runs["plain greedy"]["hash"] and every["rounds"] > 0 and every["propose_ms"] > 0
    # plainly only each reply's last token, which no draft could precede
    assert every["plain_steps"] == 2 and every["verified"] > 0 and res["propose_floor_ms"] > 0
    e2e.print_e2e({"date": "d", "device": "cpu", "backend": "cpu", "mlx": "0", "commit": "c"}, res, "tiny")
    assert f"{every['propose_ms'] / res['propose_floor_ms']:.1f}x its byte floor" in capsys.readouterr().out
    assert runs["oracle 0.56 greedy"]["hash"] == runs["plain greedy"]["hash"]
    assert runs["oracle 0.56 greedy, schedule"]["hash"] == runs["plain greedy"]["hash"]
    assert res["mlxlm"]["decode_tok_s"] > 0 and res["prefill_tok_s"] > 0 and res["prefill_seen_tok_s"] > 0
    assert res["warm_up_s"] > 0 and res["bare_step_ms"] > 0
    assert res["host_probe_ms"] > 0 and all(r["host_probe_ms"] > 0 for r in runs.values())
    assert res["mlxlm"]["host_probe_ms"] > 0
    paired = res["paired"]  # 2 prompts (prose, code) x 2 rounds, each through both engines
    assert paired["pairs"] == 4 and len(paired["ratios"]) == 4 and paired["ratio"] > 0
    assert paired["tok_s"] > 0 and paired["mlxlm_tok_s"] > 0
    paired_prefill = paired["prefill"]  # the same pairs' prefills, through the first token
    assert paired_prefill["pairs"] == 4 and paired_prefill["ratio"] == statistics.median(paired_prefill["ratios"])
    assert paired_prefill["tok_s"] > 0 and paired_prefill["mlxlm_tok_s"] > 0
    oracle = runs["oracle 0.56 greedy"]
    assert oracle["rounds"] > 0 and 0 <= oracle["oracle_right_rate"] <= 1
    paired_oracle = res["paired_oracle"]  # 2 prompts x 2 rounds, each plainly and through the oracle
    assert paired_oracle["pairs"] == 4 and paired_oracle["ratio"] == statistics.median(paired_oracle["ratios"])
    assert paired_oracle["tok_s"] > 0 and paired_oracle["plain_tok_s"] > 0 and paired_oracle["host_probe_ms"] > 0
    scheduled = res["paired_oracle_schedule"]  # the same, the schedule policy picking each round's verify
    assert scheduled["pairs"] == 4 and scheduled["tok_s"] > 0 and scheduled["plain_tok_s"] > 0
    drafted = res["paired_drafted"]  # the checkpoint's drafter under the schedule, the same way
    assert drafted["pairs"] == 4 and drafted["ratio"] == statistics.median(drafted["ratios"])
    long = res["long_context"]
    assert long["tok_s"] > 0 and long["host_probe_ms"] > 0
    for label in ("plain greedy", "plain coupled"):  # a token a step: each prompt's steps timed
        assert len(runs[label]["steps"]["first_ms"]) == 2 and runs[label]["steps"]["median_ms"] > 0
    assert not any("steps" in r for label, r in runs.items() if not label.startswith("plain"))
    floors = res["verify_floor_ms"]  # 1..6 rows: more rows take more experts
    assert len(floors) == len(res["verify_ms"]) == 6 and all(a < b for a, b in zip(floors, floors[1:]))
    assert [b["drafts"] for b in res["oracle_budget"]] == [1, 2, 3, 4, 5]
    e2e.print_e2e(harness.environment(), res, "tiny")
    printed = capsys.readouterr().out
    assert "| drafts verified | rows | tokens a round | verify budget ms |" in printed
    last = res["oracle_budget"][-1]
    assert (f"| {last['verify_ms']:.1f} | {last['fraction']:.1%} | {last['margin_ms']:.1f} | {last['added_ms']:.1f} | "
            f"{last['extra_floor_ms']:.1f} | {last['at_floor']:.2f} |") in printed
    assert f"plain greedy after a {long['prompt_tokens']}-token prompt" in printed
    assert "tokens per round; its drafts were right at a rate of" in printed
    assert (f"oracle 0.56 greedy and plain greedy interleaved prompt by prompt (median of 4 pairs' ratios; "
            f"host probe {paired_oracle['host_probe_ms']:.2f} ms): {paired_oracle['tok_s']:.2f} against "
            f"{paired_oracle['plain_tok_s']:.2f} tok/s, **{paired_oracle['ratio']:.2f}x**") in printed
    assert (f"oracle 0.56 greedy, schedule and plain greedy interleaved prompt by prompt (median of 4 pairs' "
            f"ratios; host probe {scheduled['host_probe_ms']:.2f} ms): {scheduled['tok_s']:.2f} against "
            f"{scheduled['plain_tok_s']:.2f} tok/s, **{scheduled['ratio']:.2f}x**") in printed
    assert (f"drafted greedy (the checkpoint's drafter, schedule) and plain greedy interleaved prompt by prompt "
            f"(median of 4 pairs' ratios; host probe {drafted['host_probe_ms']:.2f} ms): {drafted['tok_s']:.2f} "
            f"against {drafted['plain_tok_s']:.2f} tok/s, **{drafted['ratio']:.2f}x**") in printed
    assert f"| host probe ms (median around the run) | {runs['plain greedy']['host_probe_ms']:.2f} | " in printed
    assert f"pairs' ratios; host probe {paired['host_probe_ms']:.2f} ms) | {paired['tok_s']:.2f} | " in printed
    assert (f"pairs' ratios; host probe {paired_prefill['host_probe_ms']:.2f} ms) | {paired_prefill['tok_s']:.1f} | "
            f"{paired_prefill['mlxlm_tok_s']:.1f} | {paired_prefill['ratio']:.2f} |") in printed
    assert f"| plain greedy | {runs['plain greedy']['tok_s']:.2f} |" in printed
    assert f"| {runs['plain greedy']['host_probe_ms']:.2f} | {runs['plain greedy']['hash']} |" in printed
    assert f"plain greedy, its steps (ms): median {runs['plain greedy']['steps']['median_ms']:.2f} " in printed


def test_verify_floors_count_each_expert_once_for_the_rows_that_take_it(fixture_model):
    model = fixture_model
    one, one_experts = harness.decode_bytes(model)
    six, six_experts = harness.decode_bytes(model, rows=6)
    n_experts, k = model.args.moe_shape(0)
    taken = harness.experts_taken(n_experts, k, 6)
    assert harness.experts_taken(n_experts, k, 1) == k and k < taken < n_experts
    assert six_experts == pytest.approx(one_experts * taken / k)
    embed_row = model.embed.weight.nbytes // model.args.vocab_size
    assert six - six_experts - 5 * embed_row == pytest.approx(one - one_experts)  # the dense weights read once
    assert harness.experts_taken(24, 6, 6) == pytest.approx(24 * (1 - 0.75 ** 6))


def test_oracle_budget_gives_each_verify_what_the_target_leaves_it():
    """At rate 0.5 one draft yields 1.5 tokens a round, two 1.75: at 10 ms a plain step and
    1.5x, rounds of 10 and 11.67 ms, less 1 ms of propose and ingest."""
    rows = e2e.oracle_budget(0.5, 10.0, [10.0, 12.0, 14.0], [2.0, 3.0, 3.5], round_ms=1.0, target=1.5)
    assert [r["drafts"] for r in rows] == [1, 2]
    assert [r["tokens"] for r in rows] == pytest.approx([1.5, 1.75])
    assert [r["verify_budget_ms"] for r in rows] == pytest.approx([9.0, 1.75 * 10 / 1.5 - 1])
    assert rows[0]["needed_fraction"] == pytest.approx(3.0 / 9.0) and rows[0]["fraction"] == pytest.approx(3 / 12)
    # over a plain step (10 ms): the budget leaves one draft's second row -1 ms (under a plain
    # step), the measured forward adds 2 ms, that row's own bytes take 1 ms at the floor
    assert [r["margin_ms"] for r in rows] == pytest.approx([-1.0, 1.75 * 10 / 1.5 - 11])
    assert [r["added_ms"] for r in rows] == pytest.approx([2.0, 4.0])
    assert [r["extra_floor_ms"] for r in rows] == pytest.approx([1.0, 1.5])
    # every forward at its floor: 1.5 tokens in a 3 ms round against 2 ms a plain step
    assert [r["at_floor"] for r in rows] == pytest.approx([1.5 * 2 / 3, 1.75 * 2 / 3.5])
    assert e2e.oracle_budget(0.5, 1.0, [10.0, 12.0], [2.0, 3.0], round_ms=5.0, target=1.5)[0][
        "needed_fraction"] == float("inf")  # the round's own work already over its budget


def test_propose_table_sets_each_form_beside_the_serial_pass(capsys):
    res = {"rounds": 4, "drafter_GB": 1.5, "propose_serial_ms": 4.0, "propose_concurrent_ms": 5.0,
           "propose_thread_ms": 3.0, "ingest_1_ms": 1.0, "ingest_6_ms": 1.2,
           "propose_serial_latency_ms": 6.0, "propose_concurrent_latency_ms": 5.0, "propose_thread_latency_ms": 4.0,
           "floor_bytes": {"fp8_head": 1e9, "stage_weights": 0.5e9, "total": 1.5e9}, "copy_GB_s": 3000.0,
           "floor_ms": 0.5}
    propose.print_propose(harness.environment(), res)
    out = capsys.readouterr().out
    assert "| 4.000 | 5.000 | 1.25 | 3.000 | 0.75 | 1.000 | 1.200 |" in out
    assert "1.500 GB (fp8_head 1.000, stage_weights 0.500)" in out and "= 0.500 ms" in out
    assert "| serial | 6.000 | 12.0 |" in out and "| thread | 4.000 | 8.0 |" in out


def test_propose_floor_counts_the_head_the_stages_and_the_experts_a_block_takes(fixture_model, drafter):
    """The stages' weights but the routed experts and the ingest's main_proj, plus block x top-k
    routed experts a stage (all of them where fewer), the FP8 head whole."""
    from mlx.utils import tree_flatten

    floor = propose.propose_floor_bytes(drafter)
    head = drafter.fp8_head
    assert floor["fp8_head"] == head.codes.nbytes + head.scales.nbytes
    experts = 0
    for stage in drafter.stages:
        stacks = [v for name, v in tree_flatten(stage.ffn.experts.parameters())]
        taken = min(drafter.block * stage.ffn.gate.top_k, stacks[0].shape[0])
        experts += sum(v.nbytes // v.shape[0] * taken for v in stacks)
    assert floor["routed_experts"] == experts
    assert floor["total"] == sum(v for k, v in floor.items() if k != "total")


def test_step_summary_separates_the_typical_step_from_slow_ones():
    """Two prompts' steps (seconds): the median and mean over all, each prompt's first, the
    slowest, and what the steps over 1.5x the median add a prompt beyond it."""
    st = e2e.step_summary([[0.050, 0.010, 0.010, 0.010], [0.010, 0.010, 0.030, 0.010]])
    assert st["median_ms"] == pytest.approx(10) and st["mean_ms"] == pytest.approx(17.5)
    assert st["first_ms"] == pytest.approx([50, 10]) and st["max_ms"] == pytest.approx(50)
    assert st["slow_excess_ms"] == pytest.approx((40 + 20) / 2)


def test_environment_names_the_commit_and_says_when_the_files_differ(tmp_path, monkeypatch):
    """The table's commit is COMMIT where set, else git's short hash, with "-dirty" where the
    files differ from it (a device's copy of a checkout once answered a stale commit)."""
    import subprocess

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f.txt").write_text("a\n")
    git("add", "f.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    monkeypatch.setattr(harness, "ROOT", tmp_path)
    monkeypatch.delenv("COMMIT", raising=False)
    clean = harness.environment()["commit"]
    assert re.fullmatch(r"[0-9a-f]{7}", clean)
    (tmp_path / "f.txt").write_text("b\n")
    assert harness.environment()["commit"] == clean + "-dirty"
    monkeypatch.setenv("COMMIT", "abc1234")
    assert harness.environment()["commit"] == "abc1234"


def test_paired_decode_runs_only_where_both_models_fit():
    base = {"weights_GB": 28.0}
    assert e2e.paired_skip_reason(True, base, None) is None  # memory not known
    assert e2e.paired_skip_reason(True, base, 150 * 10**9) is None
    assert e2e.paired_skip_reason(True, base, 64 * 10**9) == "both models need ~84 GB, the device has 64 GB"
    assert e2e.paired_skip_reason(False, base, None) == "--no-paired"
    assert e2e.paired_skip_reason(True, {"unavailable": "mlx-lm: not installed"}, None) == "mlx-lm: not installed"


def test_oracle_drafts_are_right_at_its_rate(fixture_model, drafter):
    """The oracle drafter's drafts equal the continuation at the rate it stands for, and it
    counts how often its draws did."""
    sequence = list(range(1000, 1000 + 4000))
    oracle = harness.OracleDrafter(drafter, sequence, 0.56, seed=3)
    cache = oracle.make_cache()
    right = made = 0
    for end in range(0, 3000, oracle.block):
        cache.end = end
        drafts = oracle.propose(cache, 0, None).drafts.tolist()
        right += sum(d == sequence[end + 1 + k] for k, d in enumerate(drafts))
        made += len(drafts)
    assert (right, made) == (oracle.right, oracle.made)
    assert abs(oracle.right / oracle.made - 0.56) < 0.03
    confidence = mx.sigmoid(oracle.propose(cache, 0, None).confidence)  # calibrated: its own rate
    assert mx.allclose(confidence, mx.full(confidence.shape, 0.56)).item()


def test_oracle_decoders_carry_what_the_rounds_showed_from_reply_to_reply(fixture_model, runner):
    """The e2e benchmark's oracle decoders (one OracleDrafter a reply) share one Outlook per
    verify policy, as the checkpoint's drafter keeps its own across generations: the second
    reply's schedule starts from the first reply's rounds, not from a probe of one draft."""
    from dsv41_mlx.generate import generate_step
    from dsv41_mlx.sampling import SamplingParams

    make = harness.OracleDecoders(runner, 0.56)
    prompt = [5, 6, 7, 8]
    reply = list(generate_step(runner, prompt, SamplingParams(), 24))
    first = make(SamplingParams(), prompt + reply, confidence="schedule", verify_costs=[1.0] * 6)
    assert list(generate_step(runner, prompt, SamplingParams(), 24, decoder=first)) == reply
    assert first.stats.rounds > 0 and first.outlook.paying is not None
    second = make(SamplingParams(), prompt + reply, confidence="schedule", verify_costs=[1.0] * 6)
    assert second.outlook is first.outlook and second.drafter is not first.drafter
    assert make(SamplingParams(), prompt + reply).outlook is not first.outlook  # another policy: its own
    assert harness.OracleDrafter(runner.drafter, prompt + reply, 0.56).outlook is None  # a lone stand-in: none


def test_oracle_decoders_measure_the_verify_costs_once_as_the_drafters(fixture_model, runner):
    """Scheduled oracle decoders without costs given take the drafter's measured ones (measured
    once, on the first, and kept with the drafter, as a plain SpeculativeDecoder would): the
    schedule then weighs them against the rounds' own times, as for the checkpoint's drafter."""
    from dsv41_mlx.sampling import SamplingParams

    make = harness.OracleDecoders(runner, 0.56)
    assert runner.drafter.verify_costs is None
    first = make(SamplingParams(), [5, 6, 7, 8, 9], confidence="schedule")
    costs = runner.drafter.verify_costs
    assert len(costs) == runner.drafter.block + 1 and first.costs is costs and first.costs_measured
    second = make(SamplingParams(), [5, 6, 7, 8, 9], confidence="schedule")
    assert second.costs is costs and runner.drafter.verify_costs is costs


def test_oracle_without_a_rate_misses_every_kth_position(fixture_model, drafter):
    """Without a rate the oracle's draft is wrong exactly at the positions a multiple of
    wrong_every (the right token + 1), its confidence that share right, and its logits all on
    the drafts themselves (rejection sampling reads q of the draft as 1)."""
    sequence = list(range(1000, 1000 + 40))
    oracle = harness.OracleDrafter(drafter, sequence, wrong_every=5)
    cache = oracle.make_cache()
    cache.end = 7  # drafts for positions 8..12: 10 is a multiple of 5
    proposal = oracle.propose(cache, 0, None)
    assert proposal.drafts.tolist() == [1008, 1009, 1011, 1011, 1012]
    assert (oracle.right, oracle.made) == (4, 5)
    assert mx.allclose(mx.sigmoid(proposal.confidence), mx.full((5,), 0.8)).item()
    assert proposal.candidates[:, 0].tolist() == proposal.drafts.tolist() and proposal.logits.shape == (5, 1)


def test_bench_runs_the_named_benchmark_and_writes_its_json(monkeypatch, tmp_path, capsys):
    """scripts/bench.py: each benchmark its subcommand, with its own arguments; the named one
    runs and prints its table, and --json writes the run's environment and its numbers."""
    import json

    from scripts.benchmarks import head

    bench = load_script("bench")
    assert list(bench.BENCHMARKS) == ["head", "drafts", "e2e", "profile", "pieces", "gemms", "layouts", "steps",
                                      "propose", "context", "prefix", "pipeline"]
    res = {"copy_GBps": 100.0, "fp8_head_GB": 0.5, "build_s": 0.1, "rows": [
        {"rows": 3, "bf16_ms": 2.0, "mxfp8_qmm_ms": 1.5, "kernel_ms": 1.0, "kernel_top64_ms": 1.1, "floor_ms": 0.5}]}
    asked = []
    monkeypatch.setattr(head, "bench_head", lambda *args: asked.append(args) or res)
    out = tmp_path / "head.json"
    monkeypatch.setattr(sys, "argv", ["bench.py", "head", "--vocab", "4096", "--rows", "3", "--json", str(out)])
    assert bench.main() == 0
    assert asked == [(4096, 5120, [3])]
    assert "### FP8 drafter head, 4096 x 5120 (" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["head"] == res and set(written["env"]) == {"date", "device", "backend", "mlx", "commit"}


def _in_own_process(code: str) -> dict:
    """Run code (which prints one JSON line last) in a fresh interpreter: the GPU path's stubbed
    kernels get traced into MLX's compiled functions, whose traces this process must not reuse."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=SCRIPTS.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pieces_times_each_decode_kernel_beside_its_spec_on_a_gpu():
    """On a GPU, `bench.py pieces` times the sub-layer input, attention and router kernels
    beside the MLX operations they stand for; here on the CPU with the GPU path's kernels
    stubbed (scripts/count_ops.py), so the rows and the calls that fill them are checked."""
    res = _in_own_process("""
import collections, json
from scripts import count_ops
from scripts.benchmarks import pieces
calls = collections.Counter()
with count_ops.gpu_path_with_stub_kernels(calls):
    res = pieces.bench_pieces(None, [3])
print(json.dumps({"times": next(iter(res["layers"].values())), "calls": calls}))
""")
    times, calls = res["times"], res["calls"]
    for kernel, spec in (("sub-layer input, hc_input kernel", "sub-layer input, its MLX operations"),
                         ("attention, sparse_attention kernel", "attention, gathers + MLX operations"),
                         ("router, moe_gate kernels", "router, MLX operations")):
        assert times[kernel] > 0 and times[spec] > 0
    assert calls["hc_input"] and calls["sparse_attention"] and calls["moe_gate_topk"]


def test_count_ops_counts_a_propose_pass_by_stage():
    """scripts/count_ops.py --propose: a propose pass built as a GPU runs it, its launches split
    by DSpark stage, the FP8 head (one fp8_rows_top64) and the Markov steps with the confidence
    head, which add up to the pass's; each stage's MoE through the router kernels and its
    attention through the attention kernel, the Markov steps through one markov_drafts."""
    res = _in_own_process("""
import json
from scripts import count_ops
from dsv41_mlx.io.tiny import default_checkpoint
print(json.dumps(count_ops.count_propose(str(default_checkpoint()), prompt=40)))
""")
    stages, calls = res["stages"], res["kernel_calls"]
    assert len(stages) == calls["moe_gate_topk"] == calls["sparse_attention"] == 3 and all(n > 0 for n in stages)
    assert calls["fp8_rows_top64"] == calls["markov_drafts"] == 1 and res["head"] > 0
    assert 0 < res["markov_and_confidence"] <= 8  # the pass and the confidence head (5 steps of ~8 launches before)
    assert sum(stages) + res["head"] + res["markov_and_confidence"] == res["total"]
    assert 0 < res["ingest"] < res["total"]


def test_count_ops_counts_the_gpu_path_with_its_kernels():
    """scripts/count_ops.py builds a decode step as a GPU runs it (the custom kernels stubbed,
    one operation each) on the CPU: every layer's attention through the attention kernel and
    its wq_a and wkv through one fp8_gemv_pair and their norms through one rms_norm_pair (reading
    the pair's output as it lies: a plain layer makes no views), every MoE through the router
    kernels, and nothing of the patch left behind."""
    res = _in_own_process("""
import json
from scripts import count_ops
from dsv41_mlx import kernels
from dsv41_mlx.io.tiny import default_checkpoint
from dsv41_mlx.config import ModelArgs
res = count_ops.count(str(default_checkpoint()), rows=8, prompt=40)
# a context the indexers pick whole (fewer groups than index_topk): they read no index keys
res["unscored_left_in_cache"] = count_ops.count(str(default_checkpoint()), rows=8, prompt=6)["left_in_cache"]
res["restored"] = kernels.backend() == "mlx" and kernels.device_backend() == "mlx"
args = ModelArgs.from_dict(json.loads((default_checkpoint() / "config.json").read_text()))
res["engram"] = sorted(args.engram_layer_ids)
print(json.dumps(res))
""")
    layers = sum(len(v) for v in res["per_kind"].values())
    calls = res["kernel_calls"]
    assert calls["sparse_attention"] == calls["moe_gate_scores"] == calls["moe_gate_topk"] == layers
    # each attention's wq_a and wkv: one launch, and so are their norms
    assert calls["fp8_gemv_pair"] == calls["rms_norm_pair"] == layers
    # every sub-layer input is hc_input after hc_mix, or after the GEMM before it put its output
    # into the stream with the mix parts begun (fp8_mma_hc: every attention's wo_b, and a MoE's
    # shared w2 but the last block's and those before an engram layer, which adds to the stream
    # first); no launch of its own expands a stream (hc_post_mix)
    assert calls["hc_input"] == calls["hc_mix"] + calls["fp8_mma_hc"] == 2 * layers
    entered_folded = [i for i in range(1, layers) if i not in res["engram"]]
    assert entered_folded and calls["fp8_mma_hc"] == layers + len(entered_folded)
    assert "hc_post_mix" not in calls
    assert 0 < res["total"] < 200 * layers and res["views"] > 0
    # the step computes all it writes into the cache, the index keys too where no indexer reads them
    assert res["left_in_cache"] == res["unscored_left_in_cache"] == 0
    assert res["restored"]
    for kind in ("ratio 1", "ratio 2"):  # a plain layer's casts all fuse into compiled kernels
        assert res["names_per_kind"][kind].get("AsType", 0) == 0, res["names_per_kind"][kind]
        # and it makes no views: the norms read wq_a's and wkv's products where the pair put them
        assert res["views_per_kind"][kind] == [0], (kind, res["names_per_kind"][kind])
    # a decode step's one real row: every FP8 and FP4 GEMM kernel quantises its input itself
    assert "act_quant_fp8" not in calls, calls
    for kind, names in res["names_per_kind"].items():
        # RoPE's tables and the indexer's negated scores: element-wise steps fused into
        # compiled kernels, no operations of their own
        assert not {"Cos", "Sin", "Negative"} & set(names), (kind, names)
    # a pooling compressor: its groups read from where the cache wrote their rows (one join, of
    # its two GEMMs' outputs; none to the pending rows) and pooled in one element-wise launch (no
    # reductions: the one sum is the indexer's over its heads; 40 tokens are past the tiny
    # model's unscored length)
    source = res["names_per_kind"]["ratio 2 KV source + indexer"]
    assert "Max" not in source and source["Concatenate"] == 1 and source["Sum"] == 1, source
    # an engram layer: its rows dequantised without from_fp8, its gate's sums one reduction
    engram = res["names_per_kind"]["engram + ratio 2 KV source + indexer"]
    assert "FromFP8" not in engram and engram["Sum"] == 2, engram


def test_count_ops_counts_a_stubbed_kernel_as_one_launch_and_no_views():
    """A stubbed kernel is one launch whatever its outputs; their broadcasts are not counted
    as the model's views, and a real view on top of them is."""
    import collections

    from dsv41_mlx import kernels

    count_ops = load_script("count_ops")
    with count_ops.gpu_path_with_stub_kernels(collections.Counter()):
        a, b = mx.ones((4, 8)), mx.ones((3,)) * 2
        mx.eval(a, b)
        outs = kernels.compiled(kernels.ACT_QUANT, "cuda")(inputs=[a, b], output_shapes=[(4, 8), (2,), (5, 1)],
                                                           output_dtypes=[mx.bfloat16, mx.float32, mx.uint32])
        assert count_ops.census(*outs)[:2] == (1, 0)
        # a reshape, and the add's broadcast of its scalar: two views; the stub and the add: two launches
        assert count_ops.census(outs[0].reshape(32), outs[1] + 1)[:2] == (2, 2)
        # a Depends of the model's own (cache.CompressorCache.append_groups') launches nothing
        [tied] = mx.depends([outs[1] + 1], [outs[0]])
        assert count_ops.census(tied)[:2] == (2, 1)


def test_gemms_times_every_fp8_shape(monkeypatch, capsys):
    """`bench.py gemms` times MLX's FP8 GEMM at each of the model's shapes (here two small ones,
    on the CPU, where fp8_gemv does not run) beside the routed experts, and prints the table."""
    monkeypatch.setattr(gemms, "quantised_gemm_shapes", lambda: ({(256, 64)}, {(2, 512, 32)}, set()))
    # (the real measurement has a test of its own; three of 1 GiB copies take ~1.5 min on a CI core)
    monkeypatch.setattr(gemms, "copy_bandwidth", lambda: 2e11)
    res = gemms.bench_gemms(rows=3, experts=4, dim=256, inter=64, cache_bytes=1 << 16)
    assert res["copy_GBps"] == 200
    assert [r["shape"] for r in res["fp8"]] == ["256 -> 64", "2 x 512 -> 32"]
    assert all(r["mlx_ms"] > 0 and "kernel_ms" not in r for r in res["fp8"]) and len(res["routed"]) == 4
    assert all("mlx_chained_ms" in r for r in res["fp8"]) and len(res["routed_chained"]) == 2
    assert set(res["routed_chained"]) <= set(res["routed"])
    gemms.print_gemms(harness.environment(), res)
    out = capsys.readouterr().out
    assert "| 2 x 512 -> 32 |" in out and "chained" in out


def test_gemms_sweeps_the_gemv_layouts_on_a_gpu():
    """On a GPU, `bench.py gemms --real R --threads ...` also times fp8_gemv chained at each
    of those threads-per-output counts, computing R rows, and prints them as one table with
    the kernel's default marked; here on the CPU with the GPU path's kernels stubbed
    (scripts/count_ops.py)."""
    res = _in_own_process("""
import collections, contextlib, io, json
from scripts import count_ops
from scripts.benchmarks import gemms, harness
gemms.quantised_gemm_shapes = lambda: ({(256, 64), (512, 32)}, set(), set())
gemms.copy_bandwidth = lambda: 1e11  # its 1 GiB copies take half a minute on a CI core, and say nothing here
with count_ops.gpu_path_with_stub_kernels(collections.Counter()):
    res = gemms.bench_gemms(rows=8, experts=4, dim=256, inter=64, cache_bytes=1 << 16, real=1, threads=(32, 256))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        gemms.print_gemms(harness.environment(), res)
print(json.dumps({"rows": [{k: r[k] for k in ("shape", "default_threads", "kernel_chained_ms_by_threads")}
                           for r in res["fp8"]], "real": res["real"], "out": out.getvalue()}))
""")
    rows = {r["shape"]: r for r in res["rows"]}
    assert res["real"] == 1
    assert all(set(r["kernel_chained_ms_by_threads"]) == {"32", "256"} for r in rows.values())
    # few outputs: the default fills the GPU with 256 threads per output (gemv_threads_per_output)
    assert rows["256 -> 64"]["default_threads"] == rows["512 -> 32"]["default_threads"] == 256
    assert "| FP8 GEMM | C = 32 | C = 256 |" in res["out"] and "1 of 8 rows computed" in res["out"]
    assert "| 512 -> 32 | " in res["out"] and "* the kernel's default" in res["out"]
    assert re.search(r"\| 512 -> 32 \| [-0-9.]+ \| [-0-9.]+\* \|", res["out"])


def test_copy_bandwidth_keeps_the_best_of_its_measurements(monkeypatch):
    """The floor's ceiling: a device copy's bytes (read + write) over the fastest of `tries`
    measurements' times, since anything else running only slows one."""
    assert harness.copy_bandwidth(nbytes=1 << 20, tries=2) > 0  # the real copies, small
    times = iter([4e-3, 1e-3, 2e-3])
    monkeypatch.setattr(harness, "timed", lambda *args, **kwargs: next(times))
    assert harness.copy_bandwidth(nbytes=1 << 20, tries=3) == 2 * (1 << 20) / 1e-3


def test_chained_times_a_gemm_waiting_for_the_one_before():
    """`chained` charges a GEMM its latency in a chain: each link's input depends on the last
    link's output, and the chain's own element-wise links are subtracted, so a GEMM that is
    slower per call costs more per link, and nothing (up to noise) costs about zero."""
    x = mx.random.normal((4, 1, 512))
    w_small, w_big = mx.random.normal((512, 64)), mx.random.normal((512, 4096))
    mx.eval(x, w_small, w_big)
    small = harness.chained(lambda v, i: v[:, 0] @ w_small, x, links=20, reps=5)
    big = harness.chained(lambda v, i: (v[:, 0] @ w_big) @ w_big.T, x, links=20, reps=5)
    assert big > small and big > 0


def test_the_long_context_prompt_makes_every_index_layer_score(monkeypatch):
    """bench.py e2e's long-context run: its prompt (the prompts one after another, to
    indexer_scoring_length) leaves every index layer more compressed groups than its picks, so
    that each decode step scores them (the short prompts' indexers pick every position
    unscored: Indexer.picks_everything)."""
    import dsv41_mlx
    from dsv41_mlx.generate import prefill
    from dsv41_mlx.models.attention import Indexer, indexer_scoring_length
    from dsv41_mlx.runtime.runner import Runner

    model, _ = dsv41_mlx.load(None)
    ids = e2e.long_context_prompt([[5, 6, 7], [8, 9]], indexer_scoring_length(model.args))
    assert len(ids) == indexer_scoring_length(model.args) and ids[:6] == [5, 6, 7, 8, 9, 5]
    answers = []
    picks_everything = Indexer.picks_everything
    with Runner(model) as runner:
        cache = runner.make_cache()
        prefill(runner, ids, cache)
        monkeypatch.setattr(Indexer, "picks_everything", lambda self, *a: answers.append(picks_everything(self, *a))
                            or answers[-1])
        runner.decode([5], cache)
        assert len(answers) == len(model.args.index_source_layer_ids) and not any(answers)
        short = runner.make_cache()
        prefill(runner, ids[:4], short)
        answers.clear()
        runner.decode([5], short)
    assert answers and all(answers)



def test_layouts_compare_each_candidate_with_the_default_and_restore_the_choice(capsys):
    """`bench.py layouts`: on the CPU nothing to time, said so; a candidate layout is the
    kernels' only while it is measured (restored after a failure too); the table gives
    each candidate's time against the default layout's and its floor, marks the default and a
    time under the floor (the host's launches timed, not the GPU), and shows a layout that
    fails to launch or changes bits."""
    from dsv41_mlx.kernels import tuning

    env = harness.environment()
    res = layouts.bench_layouts((1,))
    assert res["cases"] == []
    layouts.print_layouts(env, res)
    assert "nothing to time" in capsys.readouterr().out
    package = tuning.current()
    with pytest.raises(RuntimeError):
        with harness.layout_choices({"attention_heads": 1, "attention_warps": {"cuda": 32}}):
            assert tuning.current().attention("cuda", 6) == (1, 32)
            raise RuntimeError("a launch failed")
    assert tuning.current() is package
    with harness.layout_choices({"experts_loads_ahead": lambda rows, k: 3, "mma_loads_ahead": lambda k, rows: 5}):
        layout = tuning.current()  # two choices at once
        assert (layout.experts_loads_ahead(6, 5120), layout.mma_loads_ahead(5120, 6)) == (3, 5)
    assert tuning.current() is package
    case = {"kernel": "fp8_mma", "shape": "1280 -> 32768", "rows": 1}
    case = {**case, "floor_us": 16.5}
    res = {"impl": "cuda", "forward_rows": 8, "copy_GBps": 4000.0, "cases": [
        {**case, "layout": 6, "default": True, "us": 20.0, "same_bits": True},
        {**case, "layout": 2, "default": False, "us": 15.0, "same_bits": True},
        {**case, "layout": 4, "default": False, "us": 30.0, "same_bits": False},
        {**case, "layout": 8, "default": False, "error": "too many resources requested for launch"}]}
    layouts.print_layouts(env, res)
    out = capsys.readouterr().out
    assert "| fp8_mma | 1280 -> 32768 | 1 | 6* | 20.0 | 16.5 | 1.00 | yes |" in out
    assert "| 2 | 15.0 ! | 16.5 | 0.75 | yes |" in out and "| 4 | 30.0 | 16.5 | 1.50 | NO |" in out
    assert "| 8 | fails: too many resources requested for launch |" in out and "(4000 GB/s)" in out


def test_steps_ab_runs_each_variant_with_its_choices_and_flags_changed_replies(monkeypatch, capsys):
    """`bench.py steps`: every variant decodes every prompt every round with its layout choices in
    kernels' place (and only then), read where a launch is traced: inside the model's fused
    (compiled) methods, whose traces each variant makes and keeps apart; the package's own
    choices come first; a variant whose replies differ from theirs is flagged; a malformed
    --variant is refused with the reason."""
    from dsv41_mlx import kernels
    from dsv41_mlx.io.tiny import default_checkpoint
    from dsv41_mlx.kernels import tuning

    real_gate, read = kernels.moe_gate, []

    def gate(*args, **kw):  # called while the MoE (a fused method) is traced; other routing under U 3
        weights, ids = real_gate(*args, **kw)
        read.append(tuning.current().mma_loads_ahead(5120, 6))
        return (weights, ids) if read[-1] != 3 else (-4 * weights, ids)

    monkeypatch.setattr(kernels, "moe_gate", gate)
    variants = dict(steps.parse_variant(v) for v in ("u3=experts_loads_ahead:3", "odd=mma_loads_ahead:3"))
    assert variants == {"u3": {"experts_loads_ahead": [(None, 3)]}, "odd": {"mma_loads_ahead": [(None, 3)]}}
    name, one_shape = steps.parse_variant("w2=mma_loads_ahead@2304/1:2,mma_loads_ahead@8192/1:4")
    package = tuning.current()
    choice = steps.variant_choice(one_shape["mma_loads_ahead"], package.mma_loads_ahead)
    assert (name, choice(2304, 1), choice(8192, 1)) == ("w2", 2, 4)  # only those calls
    assert choice(2304, 6) == package.mma_loads_ahead(2304, 6) and choice(5120, 1) == package.mma_loads_ahead(5120, 1)
    assert steps.variant_label(one_shape) == "mma_loads_ahead(2304, 1) 2, mma_loads_ahead(8192, 1) 4"
    _short_prompts(monkeypatch, steps)
    res = steps.bench_steps(str(default_checkpoint()), variants, tokens=5, rounds=2, warm=False)
    assert list(res["variants"]) == ["kernels", "u3", "odd"]
    assert 3 in read  # odd's traces made under its choice; the replies below: kept apart from the others
    assert tuning.current() is package  # restored
    v = res["variants"]
    assert v["u3"]["same_replies"] and not v["odd"]["same_replies"] and v["kernels"]["same_replies"]
    assert all(len(m) == 2 and all(x > 0 for x in m) for m in v["odd"]["step_ms"])
    progress = capsys.readouterr().out.splitlines()  # each variant's untimed runs said before the rounds
    assert [line.split(":")[0].strip() for line in progress[:3]] == ["kernels", "u3", "odd"]
    assert sum(line.lstrip().startswith("round ") for line in progress[3:]) == 2 * 3
    steps.print_steps(harness.environment(), res, "tiny")
    out = capsys.readouterr().out
    assert "| odd | mma_loads_ahead 3 |" in out and out.count("| NO |") == 1
    for bad in ("nochoices", "x=not_a_choice:1", "x=experts_loads_ahead:one", "x=mma_loads_ahead@k/1:2",
                "x=gemv_fill:8"):  # (a value, not a function of the layout)
        with pytest.raises(SystemExit, match="--variant"):
            steps.parse_variant(bad)


@contextlib.contextmanager
def _stub_layouts(monkeypatch, kernel: str, stub):
    """Inside: `bench.py layouts` runs on the CPU as on a CUDA GPU (kernels.dispatching),
    kernels.<kernel> stubbed: no copies or chains timed, and the weights, which the stub never
    reads, zeros of their shapes (not a GiB of random codes at the release's shapes)."""
    from dsv41_mlx import kernels

    def zeros(dtype):
        return lambda shape, fp4=False: mx.broadcast_to(mx.array(0, dtype), shape)

    monkeypatch.setattr(kernels, kernel, stub)
    monkeypatch.setattr(layouts, "copy_bandwidth", lambda *a: 3.5e12)
    monkeypatch.setattr(layouts, "chained", lambda run, x0: (run(x0, 1), 1e-5)[1])
    monkeypatch.setattr(layouts, "random_words", zeros(mx.uint32))
    monkeypatch.setattr(layouts, "random_scales", zeros(mx.uint8))
    with kernels.dispatching("cuda"):
        yield


def test_layouts_time_fp8_mma_tiles_and_loads_ahead_together(monkeypatch):
    """`bench.py layouts --kernels fp8_mma`, its GPU kernel stubbed: every shape and count of rows
    launched under each tile height (Layout.mma_tile_rows) with each U, labelled TR/U, the
    package's pair marked the default."""
    from dsv41_mlx.kernels import tuning

    seen = []

    def stub(x, w, scales, **kw):
        n, k, layout = w.shape[0], 4 * w.shape[1], tuning.current()
        seen.append((k, kw["real_rows"], layout.mma_tile_rows(n, k), layout.mma_loads_ahead(k, kw["real_rows"])))
        return x * 1

    package = tuning.current()
    with _stub_layouts(monkeypatch, "fp8_gemv", stub):
        res = layouts.bench_layouts((1, 6), which=("fp8_mma",))
    assert len(res["cases"]) == 4 * 2 * 8 and {c["layout"] for c in res["cases"]} == {
        f"{tr}/{u}" for tr in (32, 16) for u in (2, 4, 6, 8)}
    for k in (1280, 8192, 5120, 2304):
        for rows in (1, 6):
            assert {(tr, u) for kk, r, tr, u in seen if (kk, r) == (k, rows)} >= {(16, 2), (32, 8)}
            default = [c["layout"] for c in res["cases"] if c["default"] and c["shape"].startswith(f"{k} ")
                       and c["rows"] == rows]
            assert default == [f"{package.mma_tile_rows(1, k)}/{package.mma_loads_ahead(k, rows)}"]
    assert tuning.current() is package  # restored


def test_layouts_time_fp4_experts_loads_ahead(monkeypatch):
    """`bench.py layouts --kernels fp4_experts`, its GPU kernel stubbed: w13 and w2 at each count
    of rows launched under each U (Layout.experts_loads_ahead), the package's U marked the
    default."""
    from dsv41_mlx.kernels import tuning

    seen = []

    def stub(x, w, scales, ids, rows=None, **kw):
        k = 8 * w.shape[2]
        seen.append((k, rows, tuning.current().experts_loads_ahead(rows, k)))
        return x * 1

    package = tuning.current()
    package_u = {(k, rows): package.experts_loads_ahead(rows, k) for k in (5120, 2304) for rows in (1, 6)}
    with _stub_layouts(monkeypatch, "fp4_experts", stub):
        res = layouts.bench_layouts((1, 6), which=("fp4_experts",), experts=6)
    assert len(res["cases"]) == 2 * 2 * 4 and {c["layout"] for c in res["cases"]} == {1, 2, 3, 4}
    for (k, rows), u in package_u.items():
        assert {uu for kk, r, uu in seen if (kk, r) == (k, rows)} == {1, 2, 3, 4}
        default = [c["layout"] for c in res["cases"] if c["default"] and c["rows"] == rows
                   and c["shape"].startswith(f"{k} ")]
        assert default == [u]
    assert tuning.current() is package  # restored


def test_layouts_launch_fp8_mma_hc_as_a_forward_does(monkeypatch):
    """`bench.py layouts --kernels fp8_mma_hc`, its GPU kernel stubbed: wo_b's and the shared
    expert's w2 launches get a forward's arguments (x [8, K] bf16 quantised in the kernel, the
    stream, the computed rows, the routed experts' parts added to the shared w2's), each U
    candidate in turn, every count of rows."""
    from dsv41_mlx.kernels import tuning

    seen = []

    def stub(x, w, scales, onto, **kw):
        S, hc, n = onto.residual.shape
        assert x.shape == (S, 4 * w.shape[1]) and x.dtype == mx.bfloat16 and w.shape[0] == n == scales.shape[0]
        assert scales.shape[1] * 32 == x.shape[1] and onto.fn.shape == ((2 + hc) * hc, hc * n)
        parts = kw["parts"]
        seen.append((x.shape[1], kw["real_rows"], tuning.current().mma_loads_ahead(x.shape[1], kw["real_rows"]),
                     kw["quantize_input"], None if parts is None else parts.shape))
        return onto.residual * 1, None

    with _stub_layouts(monkeypatch, "fp8_into_stream", stub):
        res = layouts.bench_layouts((1, 6), which=("fp8_mma_hc",))
    assert len(res["cases"]) == 2 * 2 * 4 and all(c["kernel"] == "fp8_mma_hc" for c in res["cases"])
    for k, parts in ((8192, None), (2304, (6, 6, 5120))):
        for rows in (1, 6):
            got = {u for kk, r, u, q, p in seen if kk == k and r == rows and q and p == (parts and (rows, 6, 5120))}
            assert {2, 4, 6, 8} <= got, (k, rows, got)
