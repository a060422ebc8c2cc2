"""Behaviour of the target model's forward and caches on the fixture checkpoint."""

import contextlib
import threading

import mlx.core as mx
import numpy as np
import pytest

from dsv41_mlx.runtime.options import Options
from dsv41_mlx.runtime.runner import Runner


def _ids(golden):
    prompt = golden["prompt_ids"][0].astype(np.int32).tolist()
    return prompt + golden["decode.input_ids"][:, 0, 0].astype(np.int32).tolist()


def _run(model, ids, chunk, cache=None):
    cache = cache or model.make_cache()
    logits, feats = [], []
    for s in range(0, len(ids), chunk):
        lg, ft = model(mx.array([ids[s: s + chunk]], dtype=mx.int32), cache)
        logits.append(lg[0])
        feats.append(ft[0])
    return mx.concatenate(logits), mx.concatenate(feats), cache


def _two_prefilled(model, golden):
    """(the fixture's ids after the first 41, two caches that have prefilled those 41)."""
    ids = _ids(golden)
    caches = model.make_cache(), model.make_cache()
    for c in caches:
        model(mx.array([ids[:41]], dtype=mx.int32), c)
    return ids[41:], *caches


def _assert_same_state(a, b):
    sa, sb = a.snapshot(), b.snapshot()
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        assert x.shape == y.shape
        assert mx.array_equal(x, y).item()
    assert a.tokens == b.tokens


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_equals_one_shot(fixture_model, golden, chunk):
    ids = _ids(golden)
    whole_logits, whole_feats, whole_cache = _run(fixture_model, ids, len(ids))
    logits, feats, cache = _run(fixture_model, ids, chunk)
    assert mx.array_equal(whole_logits, logits).item()
    assert mx.array_equal(whole_feats, feats).item()
    _assert_same_state(whole_cache, cache)


def test_forward_shapes_and_dtypes(fixture_model):
    args = fixture_model.args
    logits, feats = fixture_model(mx.array([[5, 6, 7]], dtype=mx.int32))
    assert logits.shape == (1, 3, args.vocab_size) and logits.dtype == mx.float32
    assert feats.shape == (1, 3, len(args.dspark_target_layer_ids) * args.hidden_size)


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_trim_restores_the_state_of_a_shorter_decode(fixture_model, golden, n):
    ids = _ids(golden)
    _, _, cache = _run(fixture_model, ids, 1)
    cache.trim(n)
    _, _, shorter = _run(fixture_model, ids[:-n], 1)
    _assert_same_state(shorter, cache)


def test_rejects_bad_input_shape(fixture_model):
    with pytest.raises(ValueError, match=r"\[1, n\]"):
        fixture_model(mx.array([1, 2, 3], dtype=mx.int32))


def test_row_invariant_mode_gives_the_same_logits_and_cache(fixture_model, padded_runner, golden):
    """Padding to 8 rows and gathering each row's window changes no bit on the CPU: a decode
    forward's logits equal the plain forward's, and the trimmed cache equals its cache."""
    rest, plain, padded = _two_prefilled(fixture_model, golden)
    for start in range(0, len(rest), 3):
        chunk = rest[start: start + 3]
        want, want_f = fixture_model(mx.array([chunk], dtype=mx.int32), plain)
        got, got_f = padded_runner.decode(chunk, padded)
        assert mx.array_equal(want, got).item() and mx.array_equal(want_f, got_f).item()
        _assert_same_state(plain, padded)


def test_decode_refuses_more_rows_than_it_pads_to(padded_runner):
    with pytest.raises(ValueError, match="at most 8 rows"):
        padded_runner.decode(list(range(9)), padded_runner.make_cache())


def test_compiled_forward_equals_uncompiled(fixture_model, golden):
    """The mx.compile'd primitives (fused element-wise chains) change no bit of the
    logits, the DSpark features or the cache."""
    ids = _ids(golden)
    compiled = _run(fixture_model, ids, 5)
    mx.disable_compile()
    try:
        plain = _run(fixture_model, ids, 5)
    finally:
        mx.enable_compile()
    assert mx.array_equal(compiled[0], plain[0]).item() and mx.array_equal(compiled[1], plain[1]).item()
    _assert_same_state(compiled[2], plain[2])


def test_hc_split_checks_its_input():
    from dsv41_mlx.kernels import hc_split

    with pytest.raises(ValueError, match="hc_split"):
        hc_split(mx.zeros((2, 23)), mx.ones((3,)), mx.zeros((24,)), 4, 20, 1e-6)


def test_moe_grouped_by_expert_equals_row_by_row(fixture_model, monkeypatch):
    """Prefill groups (row, expert) pairs by expert; the result is the same bits as each
    row through its own experts."""
    import dsv41_mlx.models.moe as model_module

    moe = fixture_model.layers[3].ffn
    x = (mx.random.normal((40, fixture_model.args.hidden_size), key=mx.random.key(3))).astype(mx.bfloat16)
    grouped = moe(x)
    assert x.shape[0] * moe.gate.top_k >= model_module.SORT_EXPERTS_AT
    monkeypatch.setattr(model_module, "SORT_EXPERTS_AT", 10**9)
    mx.disable_compile()  # the compiled MoE was traced with the threshold above
    try:
        row_by_row = moe(x)
    finally:
        mx.enable_compile()
    assert mx.array_equal(grouped, row_by_row).item()


@pytest.mark.parametrize("rows", [1, 3])
def test_moe_routes_only_the_real_rows_of_a_padded_forward(fixture_model, rows):
    """A padded decode forward's real rows get the same bits as with every row routed; the
    padding rows get the shared expert alone (no routed expert runs for them)."""
    from dsv41_mlx.quant import fp8_input

    moe = fixture_model.layers[2].ffn
    x = (mx.random.normal((8, fixture_model.args.hidden_size), key=mx.random.key(5))).astype(mx.bfloat16)
    full, padded = moe(x), moe(x, rows)
    assert mx.array_equal(full[:rows], padded[:rows]).item()
    shared_only = moe.shared_experts(fp8_input(x[rows:])).astype(mx.float32).astype(mx.bfloat16)
    assert mx.array_equal(padded[rows:], shared_only).item()
    assert not mx.array_equal(full[rows:], padded[rows:]).item()


def test_fused_methods_read_the_weights_at_every_call():
    """A compiled method takes its module's current weights, so weights loaded after the
    first call are used (no stale trace)."""
    from dsv41_mlx.config import ModelArgs
    from dsv41_mlx.models.deepseek_v41 import Block
    from dsv41_mlx.io.tiny import tiny_config

    block = Block(ModelArgs.from_dict(tiny_config()), 0)
    h = mx.random.normal((3, block.hc_attn._hc, block.attn_norm.weight.shape[0]), key=mx.random.key(1))
    h, pre = h.astype(mx.bfloat16), mx.ones((3, block.hc_attn._hc)) / 4
    first = block.attn_input(h, pre)[0]
    block.load_weights([("attn_norm.weight", (2 * block.attn_norm.weight).astype(mx.bfloat16))], strict=False)
    second = block.attn_input(h, pre)[0]
    mx.disable_compile()
    try:
        expected = block.attn_input.__wrapped__(block, h, pre)[0]
    finally:
        mx.enable_compile()
    assert not mx.array_equal(first, second).item()
    assert mx.array_equal(second, expected).item()


def test_a_fused_method_that_raises_while_traced_leaves_its_weights_as_they_were():
    """A compiled method that raises while MLX traces it (here a shape it refuses) raises that
    error to its caller, and its module's weights stay the real ones: the next calls, of
    shapes seen before and new, give the uncompiled method's bits (MLX alone would leave
    tracers in their place, and every later forward failing). Interrupting it the same way
    (KeyboardInterrupt) leaves them too."""
    import mlx.nn as nn

    from dsv41_mlx.models.layers import fused

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = mx.arange(4, dtype=mx.float32)
            self.refuse: type[BaseException] | None = None

        @fused()
        def scale(self, x):
            if x.shape[0] == 3 and self.refuse is not None:
                raise self.refuse("three rows refused")
            return x * self.weight

    module = Scaled()
    x2, x3 = mx.ones((2, 4)), mx.ones((3, 4))
    assert mx.array_equal(module.scale(x2), x2 * module.weight).item()
    for refused in (ValueError, KeyboardInterrupt):
        module.refuse = refused
        with pytest.raises(refused, match="three rows refused"):
            module.scale(x3)
        assert mx.array_equal(module.weight, mx.arange(4, dtype=mx.float32)).item()
        assert mx.array_equal(module.scale(x2), x2 * module.weight).item()
    module.refuse = None
    assert mx.array_equal(module.scale(x3), x3 * module.weight).item()  # (traced afresh: no stand-in kept)
    assert mx.array_equal(module.scale(mx.ones((5, 4))), mx.ones((5, 4)) * module.weight).item()


def test_masked_picks_change_no_bit_of_the_attention():
    """The indexer pads its picks to index_topk with masked ones while the cache holds fewer
    compressed positions; the attention over them is the same bits as over the real picks."""
    from dsv41_mlx.models.attention import sparse_attention

    key = mx.random.key(11)
    S, H, D, W, K, pad = 3, 4, 64, 16, 5, 27
    q, keys, picked, sink = (mx.random.normal(shape, key=mx.random.key(i)).astype(mx.bfloat16)
                             for i, shape in enumerate([(S, H, D), (W, D), (S, K, D), (H,)]))
    sink = sink.astype(mx.float32)
    window_mask = mx.random.uniform(shape=(S, W), key=key) > 0.3
    picked_mask = mx.array([[True] * K, [True, False] * 2 + [True], [False] * K])
    extra = mx.broadcast_to(picked[:, -1:], (S, pad, D))  # padding picks read the last position
    padded = mx.concatenate([picked, extra], axis=1)
    padded_mask = mx.concatenate([picked_mask, mx.zeros((S, pad), dtype=mx.bool_)], axis=1)
    want = sparse_attention(q, keys, window_mask, picked, picked_mask, sink, 0.125)
    got = sparse_attention(q, keys, window_mask, padded, padded_mask, sink, 0.125)
    assert mx.array_equal(want, got).item()


def test_groups_of_two_pool_as_the_softmax_over_the_group_in_one_launch():
    """pooled's groups of two (the release's ratio) take the spec's steps written out per row,
    element-wise: the same bits as the softmax over the group axis and the sum over it (signs
    of zero included), as one compiled kernel with no reduction; other ratios take the spec."""

    from dsv41_mlx.models.attention import pooled

    from scripts.benchmarks import harness as bench

    def spec(kv, score):
        return (kv * mx.softmax(score, axis=1, precise=True)).sum(axis=1).astype(mx.bfloat16)

    rng = np.random.default_rng(5)
    for ratio, G, D, spread in ((2, 4, 64, 1.0), (2, 3, 512, 40.0), (2, 1, 8, 1e-3), (3, 2, 64, 4.0)):
        kv = rng.standard_normal((G, ratio, D)).astype(np.float32) * 50
        kv[0, :, :4] = 0.0  # zero rows: the sum's sign of zero
        kv[0, 0, 4:8] = -0.0
        kv = mx.array(kv)
        score = mx.array(rng.standard_normal((G, ratio, D)).astype(np.float32) * spread)
        got, want = pooled(kv, score), spec(kv, score)
        assert mx.array_equal(got.view(mx.uint16), want.view(mx.uint16)).item(), (ratio, G, D)
    ops = bench.graph_ops(pooled(mx.ones((4, 2, 64)) + 0, mx.ones((4, 2, 64)) + 0))
    assert not {"Sum", "Max"} & set(ops)
    assert sum(n for op, n in ops.items() if op.startswith("Compiled")) == 1, ops


def test_engram_rows_dequantise_in_one_launch_as_from_fp8_decodes_them():
    """engram.dequantize_rows decodes E4M3 codes from their bits: every code (NaN codes
    included) at scales around the tables', the same bits as mx.from_fp8's values times the
    scale's power of two, in one launch where that takes four."""

    from dsv41_mlx.models.engram import dequantize_rows

    from scripts.benchmarks import harness as bench

    def from_fp8(codes, scales):
        values = mx.from_fp8(codes, dtype=mx.float32).reshape(*scales.shape, -1)
        values = values * mx.power(2.0, (scales.astype(mx.int32) - 127).astype(mx.float32))[..., None]
        return values.reshape(codes.shape).astype(mx.bfloat16)

    codes = mx.array(np.tile(np.arange(256, dtype=np.uint8), 6).reshape(3, 2, 256))
    rng = np.random.default_rng(2)
    for scales in [np.full((3, 2, 8), s, np.uint8) for s in (100, 120, 127, 131, 150)] + \
            [rng.integers(105, 145, (3, 2, 8)).astype(np.uint8)]:
        got, want = dequantize_rows(codes, mx.array(scales)), from_fp8(codes, mx.array(scales))
        assert np.array_equal(np.array(got.view(mx.uint16)), np.array(want.view(mx.uint16))), scales[0, 0, 0]
    scales = mx.array(np.full((3, 2, 8), 127, np.uint8))
    mx.eval(codes, scales)
    assert bench.launches(bench.graph_ops(dequantize_rows(codes, scales))) == 1
    assert bench.launches(bench.graph_ops(mx.compile(from_fp8)(codes, scales))) == 4


def test_engram_gate_sums_in_one_reduction_the_bits_of_the_steps_as_written():
    """engram.gated_add's three sums over dim (two means, one sum) as one reduction of their
    terms side by side: the same bits as the steps written one by one (the reference's), in
    six launches where those take thirteen."""

    from dsv41_mlx.models.engram import gated_add

    from scripts.benchmarks import harness as bench

    f32 = mx.float32

    def as_written(h, kv, q_weight, k_weight, eps):
        S, hc, dim = h.shape
        key = kv[:, : hc * dim].astype(f32).reshape(S, hc, dim)
        value = kv[:, hc * dim:].astype(f32)
        weight = q_weight.astype(f32) * k_weight.astype(f32)
        hf = h.astype(f32)
        rstd = mx.rsqrt(mx.mean(hf * hf, axis=-1) + eps) * mx.rsqrt(mx.mean(key * key, axis=-1) + eps)
        dot = (hf * weight * key).sum(axis=-1) * rstd * dim ** -0.5
        root = mx.sqrt(mx.maximum(mx.abs(dot), 1e-6))
        gate = mx.sigmoid(mx.where(dot < 0, -root, root))
        return (hf + gate[..., None] * value[:, None, :]).astype(mx.bfloat16)

    for i, (S, hc, dim) in enumerate([(8, 4, 5120), (1, 4, 128), (3, 2, 64)]):
        h, kv = (mx.random.normal(shape, key=mx.random.key(10 * i + j)).astype(mx.bfloat16)
                 for j, shape in enumerate([(S, hc, dim), (S, (hc + 1) * dim)]))
        q, k = ((1 + 0.1 * mx.random.normal((hc, dim), key=mx.random.key(10 * i + j))).astype(mx.bfloat16)
                for j in (2, 3))
        got, want = gated_add(h, kv, q, k, 1e-6), as_written(h, kv, q, k, 1e-6)
        assert mx.array_equal(got.view(mx.uint16), want.view(mx.uint16)).item(), (S, hc, dim)
    h, kv, w = mx.ones((8, 4, 64), mx.bfloat16) + 0, mx.ones((8, 5 * 64), mx.bfloat16) + 0, mx.ones((4, 64)) + 0
    mx.eval(h, kv, w)
    ops = bench.graph_ops(gated_add(h, kv, w, w, 1e-6))
    assert ops["Sum"] == 1 and bench.launches(ops) == 6, ops
    assert bench.launches(bench.graph_ops(mx.compile(as_written)(h, kv, w, w, 1e-6))) == 13


def test_compressor_pools_its_groups_from_where_its_cache_wrote_their_rows(fixture_model):
    """A pooling compressor's kv and score (its two fp32 GEMMs, side by side) are written into
    the cache's raw rows, from which its groups are read with the unfinished group's rows
    before them: the groups pool as the two projections and the rows joined to the pending
    ones do."""
    from dsv41_mlx.cache import CompressorCache
    from dsv41_mlx.models.attention import pooled

    compressor = fixture_model.layers[2].attn.compressor
    assert compressor.ratio == 2
    wkv, wgate = compressor.wkv.weight, compressor.wgate.weight
    assert wkv.dtype == wgate.dtype == mx.float32
    x = mx.random.normal((5, wkv.shape[1]), key=mx.random.key(3)).astype(mx.bfloat16)
    state = CompressorCache(2)
    # 3 positions: one group and a pending row; then 5 more: three groups, the first the pending row's
    latent, first = compressor(x[:3], state)
    assert first == 0 and latent.shape[0] == 1
    state.append_groups(mx.zeros((1, 4)), mx.zeros((1, 4)))  # (as Attention._compress appends them)
    assert state.pending().shape[0] == 1
    latent, first = compressor(x, state)
    assert first == 1 and latent.shape[0] == 3 and state.end == 8
    rows = mx.concatenate([x[2:3], x]).astype(mx.float32)
    kv, score = (rows @ wkv.T).reshape(3, 2, -1), (rows @ wgate.T).reshape(3, 2, -1)
    assert mx.array_equal(latent, compressor.norm(pooled(kv, score))).item()
    state.append_groups(mx.zeros((3, 4)), mx.zeros((3, 4)))
    assert state.pending().shape[0] == 0


def test_a_forward_computes_the_index_keys_of_the_groups_it_pools(fixture_model, golden):
    """Evaluating a forward's logits also computes and writes the index keys of the groups it
    pooled, which its indexers do not read while they pick every group: nothing is left for
    the first forward that scores them (which would compute every key made before it)."""

    from scripts.benchmarks import harness as bench

    ids = _ids(golden)
    cache = fixture_model.make_cache()
    mx.eval(fixture_model(mx.array([ids[:2]], dtype=mx.int32), cache)[0])
    sources = [layer.compressor for layer in cache.layers if layer.compressor is not None]
    groups = [c.n_groups for c in sources]
    # up to index_topk (4) groups of every ratio: no indexer scores
    assert max(c.n_groups for c in sources) + 2 <= fixture_model.args.index_topk
    for token in ids[2:4]:
        logits, _ = fixture_model(mx.array([[token]], dtype=mx.int32), cache)
        mx.eval(logits)
        for c in sources:
            assert bench.launches(bench.graph_ops(c.index_keys)) == 0, bench.graph_ops(c.index_keys)
    assert all(c.n_groups > g for c, g in zip(sources, groups))  # (groups were pooled)


def test_rope_tables_of_a_narrower_width_are_views_of_a_wider_ones():
    """Rope.tables for positions whose tables of a greater width are kept: views of their last
    pairs (no launch), the values of the narrower tables computed anew."""

    from dsv41_mlx.models.layers import Rope, _rope_tables

    from scripts.benchmarks import harness as bench

    rope = Rope(16, 160000.0, 4096, 16.0)
    positions = mx.array([3, 9, 4000])
    wide = rope.tables(positions, 64)
    mx.eval(wide)
    narrow = rope.tables(positions, 32)
    want = _rope_tables(positions, *rope._per_pair(32))
    for got, expected in zip(narrow, want):
        assert got.shape == expected.shape and mx.array_equal(got, expected).item()
    assert set(bench.graph_ops(*narrow)) <= {"Slice"}
    assert rope.tables(positions, 32) is narrow  # kept
    fresh = mx.array([3, 9, 4000])  # other positions: computed, cos and sin a launch each
    tables = rope.tables(fresh, 32)
    assert "Slice" not in bench.graph_ops(*tables) and bench.launches(bench.graph_ops(*tables[:2])) == 2
    # each computing its own angles: the bits of one set of angles shared
    freqs, rotated = rope._per_pair(32)
    angles = (fresh.astype(mx.float32)[:, None] * freqs[None, :])[:, :, None]
    cos = mx.where(rotated, mx.cos(angles), 1.0)
    sin = mx.where(rotated, mx.sin(angles) * mx.array([-1.0, 1.0]), 0.0)
    for got, want in zip(tables[:3], (cos, sin, -sin)):
        assert mx.array_equal(got.view(mx.uint32), want.view(mx.uint32)).item()


def test_decode_steps_keep_their_shapes_as_the_compressed_cache_grows(fixture_model, padded_runner, monkeypatch):
    """With index_topk above the compressed positions cached, each decode step still picks
    index_topk, so the compiled attention is traced once, not once per new length (in the
    GPU's padded decode, whose per-row windows have a fixed size too)."""
    import sys

    from dsv41_mlx.generate import prefill

    for layer in fixture_model.layers:
        if hasattr(layer.attn, "indexer"):
            monkeypatch.setattr(layer.attn.indexer, "topk", 64)
    cache = fixture_model.make_cache()
    logits, _ = prefill(padded_runner, list(range(100, 140)), cache)
    traces = []

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "sparse_attention":
            traces.append(cache.offset)

    token = int(mx.argmax(logits).item())
    for step in range(8):
        out, _ = padded_runner.decode([token], cache)
        token = int(mx.argmax(out[0, -1]).item())
        if step == 0:  # the first step may trace the decode shapes
            sys.setprofile(count)
    sys.setprofile(None)
    assert traces == []


def test_overlapped_build_changes_no_bit(fixture_model, golden):
    """Starting each block on the device while the next is built (the GPU default) gives
    the same logits, features and cache as building the whole forward first."""
    ids = _ids(golden)
    with Runner(fixture_model, Options(overlap_build=True)) as runner:
        overlapped = _run(runner, ids, 5)
    whole = _run(fixture_model, ids, 5)
    assert mx.array_equal(overlapped[0], whole[0]).item() and mx.array_equal(overlapped[1], whole[1]).item()
    _assert_same_state(overlapped[2], whole[2])


def test_blocks_evaluated_on_a_thread_change_no_bit(fixture_model, golden):
    """Each block started by the evaluator's thread while the next is built (its stream, its
    thread) gives the same logits, features and cache as building the whole forward first,
    in chunks of five rows and one row, and closing it restores the GIL's switch interval."""
    import sys

    ids = _ids(golden)
    interval = sys.getswitchinterval()
    with Runner(fixture_model, Options(overlap_build=True, evaluate_on_thread=True)) as runner:
        assert sys.getswitchinterval() < interval
        threaded = _run(runner, ids, 5), _run(runner, ids[:6], 1)
    assert sys.getswitchinterval() == interval
    for got, chunk, n in zip(threaded, (5, 1), (len(ids), 6)):
        whole = _run(fixture_model, ids[:n], chunk)
        assert mx.array_equal(got[0], whole[0]).item() and mx.array_equal(got[1], whole[1]).item()
        _assert_same_state(got[2], whole[2])


@pytest.mark.parametrize("built", [False, True, "queued"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("threaded", [False, True])
def test_a_decode_begun_before_its_token_is_read_changes_no_bit(fixture_model, golden, padded, threaded, built):
    """Runner.decode_ahead with the token still lazy (each one the previous step's greedy pick):
    its first block built and started before the token is read, the rest built after, or
    (built: build_ahead) built before and started after, their engram rows written into the
    cache's StagedRows. Every step gives decode's logits, features and cache, padded to 8 rows
    or not, with the blocks started on the evaluator's thread or not (the caller's stream its
    own while the forward waits); queued: built, each token drawn on the forwards' stream and
    started by the evaluator's thread (on_forward_stream, generate_step's way), each forward
    finished unsettled. A cancelled one leaves the cache as it was (engram layers 1 and 4:
    block 0 alone is started ahead)."""
    options = Options(decode_rows=8 if padded else None, overlap_build=threaded, evaluate_on_thread=threaded,
                      build_ahead=bool(built))
    model = Runner(fixture_model, options)
    assert model._blocks_before_tokens == 1
    ids = _ids(golden)
    queued = built == "queued"
    try:
        plain, ahead = model.make_cache(), model.make_cache()
        for c in (plain, ahead):
            logits, _ = model(mx.array([ids[:41]], dtype=mx.int32), c)
        callers = mx.default_stream(mx.default_device())
        for _ in range(4):
            with model.forward_stream() if queued else contextlib.nullcontext():
                token = mx.argmax(logits[0, -1:], axis=-1)  # [1], not yet computed
            begun = model.decode_ahead(token, ahead, on_forward_stream=queued)
            assert mx.default_stream(mx.default_device()) == callers  # (not the evaluator's, while it waits)
            t = token.item()
            logits, features = begun.finish(t, settle=not queued)
            if queued:  # (what generate_step's next decode_ahead does before it waits for anything)
                model.settle()
            want, want_f = model.decode([t], plain)
            assert mx.array_equal(want, logits).item() and mx.array_equal(want_f, features).item()
            _assert_same_state(plain, ahead)
        model.decode_ahead(mx.argmax(logits[0, -1:], axis=-1), ahead).cancel()
        _assert_same_state(plain, ahead)
        want, _ = model.decode([ids[0]], plain)
        got, _ = model.decode([ids[0]], ahead)
        assert mx.array_equal(want, got).item()
    finally:
        model.close()
    assert bool(ahead.staged_rows) == bool(built)


def test_a_forward_built_ahead_starts_what_its_positions_decide_before_its_token(fixture_model, golden,
                                                                                 monkeypatch):
    """A decode_ahead built ahead starts, with its blocks before the token, the arrays that its
    positions alone decide (SharedAttention.early: the RoPE tables' cos and sin of the forward's
    positions and of its new groups, the unscored picks), so that they run before the token is
    read, not in the blocks after it; the same logits as decode."""
    from dsv41_mlx.models import attention as model_module

    made, started = [], []
    init = model_module.SharedAttention.__init__
    monkeypatch.setattr(model_module.SharedAttention, "__init__",
                        lambda self, *a, **k: (init(self, *a, **k), made.append(self))[0])
    async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: (started.extend(arrays), async_eval(*arrays))[1])
    ids = _ids(golden)
    model = Runner(fixture_model, Options(decode_rows=8, overlap_build=True, build_ahead=True))
    try:
        plain, ahead = model.make_cache(), model.make_cache()
        for c in (plain, ahead):
            logits, _ = model(mx.array([ids[:6]], dtype=mx.int32), c)
        token = mx.argmax(logits[0, -1:], axis=-1)
        begun = model.decode_ahead(token, ahead)
        early = made[-1].early
        # the window's and the compressed layers' tables of the positions, the new groups', the picks
        assert len(early) >= 6
        assert all(any(a is b for b in started) for a in early)
        logits, _ = begun.finish(token.item())
        want, _ = model.decode([token.item()], plain)
        assert mx.array_equal(want, logits).item()
    finally:
        model.close()


class _RecordingEvaluator:
    """A BlockEvaluator that only records what it is handed (nothing is started: the caller's
    eval computes it later, after the engram rows are written)."""

    def __init__(self, events):
        self.events, self.stream = events, mx.default_stream(mx.default_device())

    def submit(self, *arrays):
        self.events.append(("submit", arrays))

    def mark(self):
        done = threading.Event()
        done.set()
        return done

    def drain(self, mark=None):
        pass


def test_a_gated_forward_is_started_whole_before_its_token_and_released_after_its_rows(fixture_model, golden,
                                                                                      monkeypatch):
    """gate_rows (CUDA's default): decode_ahead hands the evaluator every block and the head
    before the token is read, the engram rows read behind a gate (kernels.rows_gate: here a
    stand-in, the CPU having no kernels); finish writes the rows, then releases the gate, once,
    and starts nothing more; the same logits as decode. A cancelled forward releases its gate
    with no rows written."""
    from dsv41_mlx.runtime import staged as engram_module

    events, gates = [], []
    monkeypatch.setattr(engram_module, "rows_gate",
                        lambda flag, rows: (gates.append(flag), (mx.zeros((2,), mx.uint32), rows))[1])
    for name in ("write", "release"):
        method = getattr(engram_module.StagedRows, name)
        monkeypatch.setattr(engram_module.StagedRows, name,
                            lambda self, *a, _m=method, _n=name, **k: (events.append((_n, k)), _m(self, *a, **k))[1])
    ids = _ids(golden)
    recorder = _RecordingEvaluator(events)
    model = Runner(fixture_model, Options(decode_rows=8, overlap_build=True, build_ahead=True, gate_rows=True))
    model._evaluator = recorder
    try:
        plain, ahead = model.make_cache(), model.make_cache()
        for c in (plain, ahead):
            logits, _ = model(mx.array([ids[:41]], dtype=mx.int32), c)
        mx.eval(logits)
        for _ in range(3):
            with model.forward_stream():
                token = mx.argmax(logits[0, -1:], axis=-1)
            events.clear()
            begun = model.decode_ahead(token, ahead, on_forward_stream=True)
            jobs = [arrays for kind, arrays in events if kind == "submit"]
            assert gates and len(events) == len(jobs)
            # the token's, block 0's, the early arrays, the rows, every block after, the head's logits
            assert len(jobs) == len(fixture_model.layers) + 4 and jobs[-1][0].shape == (1, 8, model.args.vocab_size)
            t = token.item()
            logits, features = begun.finish(t, settle=False)
            assert [kind for kind, _ in events[len(jobs):]] == ["write", "release"]  # nothing started after the token
            want, want_f = model.decode([t], plain)
            assert mx.array_equal(want, logits).item() and mx.array_equal(want_f, features).item()
            _assert_same_state(plain, ahead)
        events.clear()
        model.decode_ahead(mx.argmax(logits[0, -1:], axis=-1), ahead, on_forward_stream=True).cancel()
        assert [(kind, k) for kind, k in events if kind != "submit"] == [("release", {"check": False})]
        _assert_same_state(plain, ahead)
        assert ahead.staged_rows[8].flag is not None
    finally:
        model._evaluator = None


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("blocks", [1, 2, 5, None])
def test_a_verify_forward_begun_before_its_drafts_are_read_changes_no_bit(fixture_model, golden, monkeypatch,
                                                                          blocks, gated):
    """Runner.verify_ahead on tokens still being computed (an anchor and drafts, padded to 8
    rows): its first `blocks` blocks built (and, gated, started behind a stand-in gate, with an
    evaluator that only records, so that nothing runs before the rows are written) before the
    tokens are read, the rest built by finish_rows. Each forward gives decode's logits,
    features and cache, for 1 to 6 real rows; a cancelled one leaves the cache as it was."""
    from dsv41_mlx.runtime import staged as staged_module

    monkeypatch.setattr(staged_module, "rows_gate", lambda flag, rows: (mx.zeros((2,), mx.uint32), rows))
    ids = _ids(golden)
    model = Runner(fixture_model, Options(decode_rows=8, overlap_build=True, evaluate_on_thread=not gated,
                                          build_ahead=True, gate_rows=gated))
    if gated:
        model._evaluator = _RecordingEvaluator([])
    try:
        plain, ahead = model.make_cache(), model.make_cache()
        for c in (plain, ahead):
            logits, _ = model(mx.array([ids[:41]], dtype=mx.int32), c)
        for n in (1, 6, 3):
            drafts = (mx.argmax(logits[0, -1:], axis=-1) + mx.arange(8)) % model.args.vocab_size  # not yet computed
            padded = mx.concatenate([drafts[:n], mx.broadcast_to(drafts[n - 1: n], (8 - n,))]).astype(mx.int32)
            begun = model.verify_ahead(padded, n, ahead, blocks)
            tokens = drafts[:n].tolist()
            logits, features = begun.finish_rows(tokens)
            want, want_f = model.decode(tokens, plain)
            assert mx.array_equal(want, logits).item() and mx.array_equal(want_f, features).item()
            _assert_same_state(plain, ahead)
        model.verify_ahead(mx.zeros((8,), mx.int32), 4, ahead, blocks).cancel()
        _assert_same_state(plain, ahead)
        with pytest.raises(ValueError, match="begun for 4 tokens"):
            model.verify_ahead(mx.zeros((8,), mx.int32), 4, ahead, blocks).finish_rows([1, 2])
    finally:
        model._evaluator = None if gated else model._evaluator
        model.close()


def test_staged_rows_release_reports_a_gate_that_gave_up():
    """StagedRows.release counts the host's releases in flag[0]; where a gate gave up waiting
    (flag[2], the device's count) it raises, after releasing all the same. Without a gate,
    values(gated=True) and release say so."""
    from dsv41_mlx.runtime.staged import StagedRows

    staged = StagedRows([(1, 2, 4), (1, 2, 1)], gated=True)
    staged.release()
    staged.release()
    assert np.array(staged.flag).tolist() == [2, 0, 0]
    np.array(staged.flag, copy=False)[2] = 1
    with pytest.raises(RuntimeError, match="stopped waiting for the host's engram rows"):
        staged.release()
    assert np.array(staged.flag).tolist()[0] == 3
    staged.release(check=False)
    ungated = StagedRows([(1, 2, 4), (1, 2, 1)])
    for call in (lambda: ungated.values(gated=True), ungated.release):
        with pytest.raises(RuntimeError, match="without a gate"):
            call()


def test_block_evaluator_hands_its_threads_error_to_the_caller(monkeypatch):
    """What the thread's mx.async_eval raises comes out of the next drain, on the caller's
    thread; the evaluator then runs again."""
    from dsv41_mlx.runtime import evaluator as ev

    evaluator = ev.BlockEvaluator()
    try:
        def broken(*arrays):
            raise RuntimeError("no memory left")

        monkeypatch.setattr(ev.mx, "async_eval", broken)
        evaluator.submit(mx.ones(3))
        with pytest.raises(RuntimeError, match="no memory left"):
            evaluator.drain()
        monkeypatch.undo()
        with mx.stream(evaluator.stream):
            y = mx.ones(3) * 2
        evaluator.submit(y)
        evaluator.drain()
        assert y.tolist() == [2.0, 2.0, 2.0]
    finally:
        evaluator.close()
    with pytest.raises(RuntimeError, match="closed"):
        evaluator.submit(mx.ones(3))
    evaluator.drain()  # closed, it started everything before it stopped: a forward abandoned later drains at once


@pytest.mark.parametrize("batch, calls", [(None, [1, 10]), (2, [1, 4, 4, 2])])
def test_block_evaluator_starts_at_most_batch_blocks_handed_over_together(monkeypatch, batch, calls):
    """Blocks handed over while the thread is busy start together, in one mx.async_eval: all of
    them, or at most `batch`, in the order they came."""
    import threading

    from dsv41_mlx.runtime import evaluator as ev

    gate, seen = threading.Event(), []

    def recording(*arrays):
        seen.append(len(arrays))
        gate.wait()

    monkeypatch.setattr(ev.mx, "async_eval", recording)
    evaluator = ev.BlockEvaluator(batch=batch)
    try:
        a = mx.ones(2)
        evaluator.submit(a)  # the thread takes it and waits inside "async_eval"
        while not seen:
            gate.wait(0.001)
        for _ in range(5):
            evaluator.submit(a, a)
        gate.set()
        evaluator.drain()
    finally:
        evaluator.close()
    assert seen == calls


def _no_build(spec, language):
    """A kernel builder for kernels.dispatching where no kernel may launch (a test's stand-ins
    take the calls that would)."""
    raise AssertionError(f"kernel {spec.name} built on the CPU")


def test_routed_experts_take_the_fp4_kernel_for_a_decode_steps_pairs_on_a_gpu(monkeypatch):
    """On a GPU, a decode or verify step's (row, expert) pairs run kernels.fp4_experts, handed
    x, the ids and the pairs' weights of every row as they are with the real rows as its R (no
    views): the gate and up projection with x per row and its SwiGLU (each pair's weight
    applied), the down projection with x per pair, whose bf16 input the kernel quantises as it
    reads it for up to 8 rows and act_quant quantises first for more. More than 16 rows, or
    a shape the kernel does not take, keep MLX's gather_qmm, then kernels.swiglu_pairs; either
    way the real rows' values are the spec's."""
    from dsv41_mlx import kernels
    from dsv41_mlx.config import ModelArgs
    from dsv41_mlx.kernels import tuning
    from dsv41_mlx.models.moe import MoE
    from dsv41_mlx.quant import fp8_fake_quant_reference
    from dsv41_mlx.io.tiny import tiny_config

    from .test_kernels import act_quant_spec

    calls = []

    def experts(x, w, s, ids, impl=None, init_value=None, quantize_input=False, swiglu=None, rows=None):
        calls.append((x.shape, ids.shape, rows, quantize_input, swiglu is not None and swiglu.weights is not None))
        return kernels.fp4_experts_reference(x, w, s, ids, quantize_input, swiglu, rows)

    def moe_of(dim: int, inter: int) -> MoE:
        args = ModelArgs.from_dict(tiny_config())
        args.hidden_size, args.moe_intermediate_size, args.n_routed_experts, args.num_experts_per_tok = dim, inter, 5, 3
        moe = MoE(args, 0)
        for stack in (moe.experts.w13, moe.experts.w2):
            stack.weight = mx.random.randint(0, 2**31, stack.weight.shape).astype(mx.uint32)
            stack.scales = mx.random.randint(118, 124, stack.scales.shape).astype(mx.uint8)
        return moe

    mx.random.seed(6)
    moe = moe_of(256, 256)
    for padded, real in ((8, 1), (8, 6), (16, 16), (17, 17)):
        ids = mx.array(np.stack([np.random.default_rng(r).permutation(5)[:3] for r in range(padded)]).astype(np.uint32))
        x8 = fp8_fake_quant_reference(mx.random.normal((padded, 256))).astype(mx.bfloat16)
        weights = mx.random.uniform(shape=ids.shape)
        want = moe._routed_rows(x8, weights, ids, real)  # on the CPU: MLX's gather_qmm, the spec
        with monkeypatch.context() as m, kernels.dispatching("cuda", _no_build):
            m.setattr(kernels, "fp4_experts", experts)
            m.setattr(kernels, "act_quant_fp8", act_quant_spec)  # where the kernel does not quantise
            calls.clear()
            got = moe._routed_rows(x8, weights, ids, real)
        in_kernel = real <= tuning.current().quantize_in_mma_rows
        assert calls == ([((padded, 256), (padded, 3), real, False, True),
                          ((real, 3, 256), (padded, 3), real, in_kernel, False)] if padded <= 16 else [])
        assert got.shape == want.shape == (real, 3, 256) and mx.array_equal(got, want).item()
    small = moe_of(128, 256)  # 128 inputs: not the kernel's
    with monkeypatch.context() as m, kernels.dispatching("cuda", _no_build):
        m.setattr(kernels, "fp4_experts", experts)
        m.setattr(kernels, "act_quant_fp8", act_quant_spec)
        calls.clear()
        small._routed_rows(mx.zeros((2, 128), dtype=mx.bfloat16), mx.ones((2, 3)), mx.array([[0, 1, 2], [2, 3, 4]],
                                                                                           dtype=mx.uint32), 2)
    assert calls == []


def _fresh_traces(monkeypatch, model) -> None:
    """For this test, every compiled method of the model's modules starts without traces
    (model.fused keeps them on the instance): a forward under a patched dispatch traces again
    and so reaches the patched kernels, whatever earlier tests traced, and its traces are
    dropped after the test."""
    from dsv41_mlx.models.layers import fused_traces

    for module in model.modules():
        for name in fused_traces(type(module)):
            monkeypatch.setitem(module.__dict__, name, {})


def _gpu_dispatch_with_specs(monkeypatch, model, attention, gemv=None) -> None:
    """A forward of `model` takes the GPU's attention path, its kernel (answered fit as on CUDA)
    `attention`, and where `gemv` is given, the GPU's FP8 GEMMs of up to 16 rows, which are
    `gemv`; every other kernel keeps the CPU's path, its pure-MLX spec. The model's compiled
    methods trace afresh (_fresh_traces)."""
    from dsv41_mlx import kernels

    _fresh_traces(monkeypatch, model)
    fits = kernels.attention_fits
    monkeypatch.setattr(kernels, "attention_fits", lambda *args, impl=None: fits(*args, impl="cuda"))
    monkeypatch.setattr(kernels, "sparse_attention_rows", attention)
    if gemv is not None:
        monkeypatch.setattr(kernels, "fp8_gemv_fits", lambda x, w, impl=None, groups=0: x.shape[0] <= 16 if groups else
                            x.size // x.shape[-1] <= 16 * w.shape[0] if w.ndim == 3 else x.size // x.shape[-1] <= 16)
        monkeypatch.setattr(kernels, "fp8_gemv", gemv)


def test_attention_kernel_takes_the_queries_unrotated_and_rotates_its_output_back(fixture_model, padded_runner, golden,
                                                                                  monkeypatch):
    """On a GPU a decode or verify step's attention runs kernels.sparse_attention_rows, which
    rotates q and its output back itself: queries leaves q unrotated and output skips the
    inverse rotation (two launches fewer per layer). With that kernel replaced by its spec
    (scripts/check_kernels.py) and every other kernel on its spec, decode steps are the same
    bits as the CPU's path, whose queries and output rotate: logits, features and cache."""
    from scripts.kernel_checks.sparse_attention import sparse_attention_spec as spec

    model = padded_runner
    rest, plain, kernel = _two_prefilled(fixture_model, golden)
    want = [model.decode(rest[start: start + 3], plain) for start in range(0, len(rest), 3)]
    calls = []

    def attention(*args, impl=None):
        calls.append(args[0].shape)
        return spec(*args)

    _gpu_dispatch_with_specs(monkeypatch, fixture_model, attention)
    got = [model.decode(rest[start: start + 3], kernel) for start in range(0, len(rest), 3)]
    # every layer through the kernel, with q as wq_b gives it, [S, H * D] (the kernel reads it as [S, H, D]), traced
    # once: inside a compiled method, whose inputs (the whole window and group buffers) kept their shapes
    assert calls == [(8, model.args.num_attention_heads * model.args.head_dim)] * len(fixture_model.layers)
    for (want_logits, want_feats), (logits, feats) in zip(want, got):
        assert mx.array_equal(want_logits, logits).item() and mx.array_equal(want_feats, feats).item()
    _assert_same_state(plain, kernel)


def test_window_cache_keeps_the_newest_rows_through_its_buffer_moves():
    """Decode-like updates (8 rows written, 7 trimmed) and a long chunk: the kept rows and the
    rows an update returns are always the newest ones, oldest first, across the buffer's moves,
    and the whole buffer holds them where WindowCache.buffer says."""
    from dsv41_mlx.cache import TRIM_SLACK, WindowCache

    cache, rows = WindowCache(4), []  # rows: every position's row, as a plain list
    for step, size in enumerate([3] + [8] * 40 + [50] + [8] * 10):
        new = mx.arange(size * 2, dtype=mx.float32).reshape(size, 2) + 1000 * step
        keys, first = cache.update(new)
        rows += new.tolist()
        assert first == len(rows) - keys.shape[0] and keys.tolist() == rows[first:]
        # the whole buffer (what the attention kernel reads) holds them from the row it names, and its
        # rows are a power of two (few shapes for the compiled path to trace)
        buffer, row = cache.buffer(first)
        assert buffer[row: row + keys.shape[0]].tolist() == keys.tolist()
        assert buffer.shape[0] & (buffer.shape[0] - 1) == 0
        if size == 8:
            cache.trim(7)
            del rows[-7:]
        held = cache.keys
        assert held.shape[0] <= 4 + TRIM_SLACK and held.tolist() == rows[len(rows) - held.shape[0]:]
        assert cache.start == len(rows) - held.shape[0] and cache.end == len(rows)


def test_row_buffer_appends_and_drops_at_both_ends_across_moves():
    """RowBuffer (the caches' store): the rows held are always the appended ones less those
    dropped, in order, while its buffer grows and moves."""
    from dsv41_mlx.cache import RowBuffer

    buf, rows = RowBuffer(min_room=2), []
    assert buf.rows is None and len(buf) == 0
    for step in range(30):
        new = mx.full((1 + step % 3, 2), step, dtype=mx.int32)
        held = buf.append(new)
        rows += new.tolist()
        assert held.tolist() == rows
        if step % 4 == 3:
            buf.drop_front(2)
            del rows[:2]
        if step % 5 == 4:
            buf.drop_back(1)
            rows.pop()
        assert buf.rows.tolist() == rows and len(buf) == len(rows)


def test_blocks_hand_on_their_output_unexpanded_to_the_next_blocks_input_kernel(monkeypatch, golden):
    """On a GPU each block leaves its MoE output unexpanded (model.Expansion) and the next
    block's sub-layer input kernel expands it (kernels.hc_post_input), as the MoE's input
    kernel expands the attention's output; engram layers and DSpark feature taps take the
    stream whole first, and the last block expands its own. Here the kernels are their specs
    on the CPU: the forward's logits, features and cache are the plain path's bits, and the
    expanding kernel runs where it should."""
    from dsv41_mlx import load

    from .conftest import FIXTURE

    ids = _ids(golden)[:12]
    want = _run(load(FIXTURE)[0], ids, 4)
    calls = []
    _sublayer_input_specs(monkeypatch, calls)
    model = load(FIXTURE)[0]  # a fresh model: its compiled methods trace the patched path
    got = _run(model, ids, 4)
    assert mx.array_equal(got[0], want[0]).item() and mx.array_equal(got[1], want[1]).item()
    _assert_same_state(got[2], want[2])
    args, layers = model.args, model.args.num_hidden_layers
    whole_first = {0} | set(args.engram_layer_ids) | set(args.dspark_target_layer_ids)
    per_forward = layers + sum(1 for i in range(layers) if i not in whole_first)  # every MoE input, then blocks
    # the compiled methods trace once (three forwards of one shape): a forward's calls
    assert calls.count("hc_post_input") == per_forward
    assert len(calls) == 2 * layers + per_forward  # every sub-layer input: hc_input, after its expansion or not


def _sublayer_input_specs(monkeypatch, calls: list):
    """kernels.hc_input and kernels.hc_post_input as their specs on the CPU, each call
    recorded in `calls` (hc_post_input's hc_input too), hc_input fitting a decode or verify
    step's bf16 stream: the GPU path's sub-layer inputs. Returns hc_input's spec, unrecorded."""
    from dsv41_mlx import kernels
    from dsv41_mlx.models.hyper import _hc_post, _hc_project, hc_pre
    from dsv41_mlx.quant import fp8_fake_quant

    def spec(h, pre_in, fn, scale, base, norm_w, iters, hc_norm_eps, eps, norm_eps, quantize_to):
        x = kernels.rms_norm(hc_pre(h, pre_in), norm_w, norm_eps)
        mixes = kernels.hc_split(_hc_project(h, fn, hc_norm_eps), scale, base, h.shape[1], iters, eps)
        return (x, fp8_fake_quant(x, dtype=quantize_to), *mixes)

    def hc_input(*args, impl=None):
        calls.append("hc_input")
        return spec(*args)

    def hc_post_input(y, residual, post, comb, pre_in, *args, impl=None):
        calls.append("hc_post_input")
        h = _hc_post(y, residual, post, comb)
        return (h, *hc_input(h, pre_in, *args))

    monkeypatch.setattr(kernels, "hc_input_fits", lambda h, impl=None: h.dtype == mx.bfloat16 and h.shape[0] <= 16)
    monkeypatch.setattr(kernels, "hc_input", hc_input)
    monkeypatch.setattr(kernels, "hc_post_input", hc_post_input)
    return spec


def test_sub_layers_put_their_output_into_the_stream_through_their_last_gemm(monkeypatch, golden):
    """On a GPU the attention's wo_b and the MoE's shared w2 write their output into the stream
    themselves, with the next sub-layer's mix parts (kernels.fp8_into_stream), and the next
    sub-layer's input kernel completes those (kernels.hc_input_from_parts): every attention,
    and every MoE but the last block's and those before an engram layer, which adds to the
    stream first. Here the two kernels are specs that carry the whole projection as one part
    (and every other kernel its spec, on the CPU): the forward's logits, features and cache
    are the plain path's bits, each GEMM put its output into the stream it ran on, with the
    mix projection of the sub-layer after it, and no launch of its own expands a stream."""
    from dsv41_mlx import kernels, load, quant
    from dsv41_mlx.models.hyper import _hc_post

    from .conftest import FIXTURE

    ids = _ids(golden)[:12]
    want = _run(load(FIXTURE)[0], ids, 4)
    model = load(FIXTURE)[0]  # a fresh model: its compiled methods trace the patched path
    calls, onto_fns = [], []
    spec = _sublayer_input_specs(monkeypatch, calls)

    def into_stream(x, w, s, onto, impl=None, quantize_input=False, real_rows=None, parts=None):
        calls.append("into_stream")
        residual, post, comb, fn = onto
        y = quant.fp8_matmul(quant.fp8_input(x), w, s, real_rows, parts=parts)
        h = _hc_post(y, residual, post, comb)
        return h, fn  # the part: the projection itself, which from_parts takes as it is

    def from_parts(h, fn, pre_in, scale, base, norm_w, iters, hc_norm_eps, eps, norm_eps, quantize_to, impl=None):
        calls.append("from_parts")
        return spec(h, pre_in, fn, scale, base, norm_w, iters, hc_norm_eps, eps, norm_eps, quantize_to)

    def stream_onto(residual, post, comb, fn):  # what a block hands a GEMM (outside the compiled methods)
        onto_fns.append(fn)
        return onto_type(residual, post, comb, fn)

    monkeypatch.setattr(kernels, "fp8_into_stream_fits", lambda w, residual, impl=None: residual.shape[0] <= 16
                        and w.shape[0] == model.args.hidden_size)
    onto_type = kernels.StreamOnto
    for name, fake in (("fp8_into_stream", into_stream), ("hc_input_from_parts", from_parts),
                       ("StreamOnto", stream_onto)):
        monkeypatch.setattr(kernels, name, fake)
    got = _run(model, ids, 4)
    assert mx.array_equal(got[0], want[0]).item() and mx.array_equal(got[1], want[1]).item()
    _assert_same_state(got[2], want[2])
    args, layers = model.args, model.args.num_hidden_layers
    folded_moes = [i for i in range(layers - 1) if i + 1 not in args.engram_layer_ids]
    # the compiled methods trace once (three forwards of one shape): a forward's calls
    assert calls.count("into_stream") == calls.count("from_parts") == layers + len(folded_moes)
    # every other sub-layer input projects its stream itself; none expands one
    assert calls.count("hc_input") == 2 * layers - calls.count("from_parts") and "hc_post_input" not in calls
    blocks = model.layers
    want_fns = [f for i in range(layers) for f in
                [blocks[i].hc_ffn.fn] + ([blocks[i + 1].hc_attn.fn] if i in folded_moes else [])]
    assert len(onto_fns) == 3 * len(want_fns)  # 3 forwards
    assert all(mx.array_equal(f, w).item() for f, w in zip(onto_fns, 3 * want_fns))


def test_padded_forwards_compute_their_real_rows_alone(fixture_model, padded_runner, golden, monkeypatch):
    """A padded decode or verify forward on a GPU computes its real rows alone where a kernel
    can skip the padding: the FP8 GEMMs (kernels.fp8_gemv's real_rows) and the attention give
    the padding rows zeros. With those kernels their specs (zeros after the real rows), decode
    steps of 3 real rows in 8 are the CPU path's bits (logits, features and cache), every
    GEMM call of the forwards was told how many rows are real, wo_a's took attention's
    output as it is (its groups given, no reshapes), and the shared expert's w13 (the one
    GEMM with a SwiGLU) waits for the router's picks (`after`: where a CUDA graph runs it)."""
    from dsv41_mlx import kernels

    from scripts.kernel_checks.sparse_attention import sparse_attention_spec as spec

    model = padded_runner
    rest, plain, kernel = _two_prefilled(fixture_model, golden)
    want = [model.decode(rest[start: start + 3], plain) for start in range(0, len(rest), 3)]
    told, grouped, waits = [], [], []

    def gemv(x, w, s, impl=None, init_value=None, quantize_input=False, real_rows=None, swiglu=None, parts=None,
             groups=0, after=None):
        told.append(real_rows)
        grouped.append(groups)
        waits.append((swiglu is not None, None if after is None else (after.dtype, after.shape)))
        return kernels.fp8_gemv_reference(x, w, s, quantize_input, real_rows, swiglu, parts, groups)

    _gpu_dispatch_with_specs(monkeypatch, fixture_model, lambda *args, impl=None: spec(*args), gemv)
    got = [model.decode(rest[start: start + 3], kernel) for start in range(0, len(rest), 3)]
    for (want_logits, want_feats), (logits, feats) in zip(want, got):
        assert mx.array_equal(want_logits, logits).item() and mx.array_equal(want_feats, feats).item()
    _assert_same_state(plain, kernel)
    assert told and set(told) <= {3, len(rest) % 3 or 3}  # traced once per real-row count
    # wo_a: attention's output [S, H, D] and the stacked weight as they are, read as its groups
    assert grouped.count(model.args.o_groups) == len(fixture_model.layers) * len(set(told))
    picks = [after for swiglu, after in waits if swiglu]
    assert len(picks) == len(fixture_model.layers) * len(set(told))
    assert all(after is not None and after[0] == mx.uint32 and after[1][1] == model.args.num_experts_per_tok
               for after in picks), picks
    assert all(after is None for swiglu, after in waits if not swiglu)


def test_attention_projects_and_norms_through_the_pair_launches(fixture_model, padded_runner, golden, monkeypatch):
    """On a GPU a decode or verify step's attention makes wq_a's and wkv's products in one
    launch (kernels.fp8_gemv_pair, split at q_lora_rank, both in its one output) and their
    norms in another that reads them there (kernels.rms_norm_halves: q_norm quantised as wq_b
    takes it, kv_norm rotated and quantised as the window keeps it). With the two launches
    their specs (the single GEMMs and norms) and every other kernel on its spec, padded decode
    steps are the CPU path's bits (logits, features and cache), and each layer of each forward
    launched each once."""
    from dsv41_mlx import kernels
    from dsv41_mlx.models.layers import rotate
    from dsv41_mlx.quant import fp8_fake_quant_reference

    from scripts.kernel_checks.sparse_attention import sparse_attention_spec as spec

    model = padded_runner
    rest, plain, kernel = _two_prefilled(fixture_model, golden)
    want = [model.decode(rest[start: start + 3], plain) for start in range(0, len(rest), 3)]
    pairs, norms = [], []

    def gemv_pair(x, w, s, split, impl=None, real_rows=None):
        pairs.append((x.shape, split, real_rows))
        return mx.concatenate([kernels.fp8_gemv_reference(x, w[rows], s[rows], real_rows=real_rows).reshape(-1)
                               for rows in (slice(0, split), slice(split, None))])

    def norm_halves(both, rows, split, w, w2, eps, quantize_to, quantize_to2, rope2, impl=None):
        x, x2 = kernels.pair_halves(both, rows, split)
        norms.append((x.shape, x2.shape, quantize_to, quantize_to2))
        cos, sin, dims = rope2
        S, D = x2.shape
        pair = (S, D // 2, 2)
        rotated = rotate(kernels.rms_norm_reference(x2, w2, eps), cos.reshape(pair), sin.reshape(pair),
                         (mx.arange(D) >= D - dims).reshape(pair[1:]))
        return (fp8_fake_quant_reference(kernels.rms_norm_reference(x, w, eps)).astype(quantize_to),
                fp8_fake_quant_reference(rotated).astype(quantize_to2))

    _gpu_dispatch_with_specs(monkeypatch, fixture_model, lambda *args, impl=None: spec(*args))
    monkeypatch.setattr(kernels, "fp8_gemv_pair_fits", lambda x, w, split, impl=None: True)
    monkeypatch.setattr(kernels, "fp8_gemv_pair", gemv_pair)
    monkeypatch.setattr(kernels, "rms_norm_halves", norm_halves)
    got = [model.decode(rest[start: start + 3], kernel) for start in range(0, len(rest), 3)]
    for (want_logits, want_feats), (logits, feats) in zip(want, got):
        assert mx.array_equal(want_logits, logits).item() and mx.array_equal(want_feats, feats).item()
    _assert_same_state(plain, kernel)
    q_lora, head_dim, dim = model.args.q_lora_rank, model.args.head_dim, model.args.hidden_size
    # traced once per real-row count (3, then the last forward's), by every layer
    assert len(pairs) == len(norms) == len(fixture_model.layers) * len({3, len(rest) % 3 or 3})
    assert {p[:2] for p in pairs} == {((8, dim), q_lora)} and {p[2] for p in pairs} <= {3, len(rest) % 3 or 3}
    assert set(norms) == {((8, q_lora), (8, head_dim), mx.float32, mx.bfloat16)}


@pytest.mark.parametrize("rows", [None, 8])
def test_indexer_skips_its_scores_while_it_picks_every_position(fixture_model, golden, monkeypatch, rows):
    """While an indexer's k picks hold every compressed position (n <= k) and no candidate mask
    restricts them, the scores cannot change its top-k: it hands on every position a row sees
    (SharedAttention.every_pick) without scoring. A sequence decoded from its first token, as
    n grows past k (and past the candidate source's blocks), gives the same bits as with the
    scoring forced at every step: logits, features and cache; plain and padded to 8 rows."""
    from dsv41_mlx.models.attention import Indexer

    model = Runner(fixture_model, Options(decode_rows=rows))
    ids = _ids(golden)
    taken = []
    picks_everything = Indexer.picks_everything

    def counted(self, n, masks, shared):
        taken.append(picks_everything(self, n, masks, shared))
        return taken[-1]

    try:
        monkeypatch.setattr(Indexer, "picks_everything", counted)
        cache = model.make_cache()
        skipping = [model.decode(ids[s: s + 3], cache) for s in range(0, len(ids), 3)]
        monkeypatch.setattr(Indexer, "picks_everything", lambda self, n, masks, shared: False)
        scored_cache = model.make_cache()
        scored = [model.decode(ids[s: s + 3], scored_cache) for s in range(0, len(ids), 3)]
    finally:
        model.close()
    assert any(taken) and not all(taken)  # both regimes ran
    for (logits, feats), (want_logits, want_feats) in zip(skipping, scored):
        assert mx.array_equal(logits, want_logits).item() and mx.array_equal(feats, want_feats).item()
    _assert_same_state(cache, scored_cache)


def test_an_indexer_scores_long_chunks_in_slices_of_rows_with_the_same_picks(fixture_model, golden, monkeypatch):
    """Where a forward's scores [rows, heads, keys] would pass SCORE_BYTES, an indexer scores its
    rows in slices (the last one shorter): a prompt prefilled in chunks scored 5 rows at a time,
    candidate masks and all, gives the same logits, features and cache as scored whole, and so do
    the decode steps after it."""
    from dsv41_mlx.generate import prefill
    from dsv41_mlx.models import attention

    ids = _ids(golden)
    asked = []
    score_rows = attention.score_rows

    def results(slice_rows):
        def counted(rows, heads, keys):
            asked.append(rows)
            return slice_rows(rows, heads, keys)

        monkeypatch.setattr(attention, "score_rows", counted)
        with Runner(fixture_model) as runner:
            cache = runner.make_cache()
            logits, features = prefill(runner, ids[:-4], cache, chunk=24, keep_features=8)
            steps = [runner.decode([t], cache) for t in ids[-4:]]
        return [logits, features] + [a for step in steps for a in step], cache

    whole, whole_cache = results(score_rows)
    assert asked and all(score_rows(rows, 64, 1 << 10) == rows for rows in asked)  # nothing sliced by default
    asked.clear()
    sliced, sliced_cache = results(lambda rows, heads, keys: min(rows, 5))
    assert max(asked) > 5 and any(rows % 5 for rows in asked if rows > 5)  # sliced, a last slice shorter
    assert all(mx.array_equal(a, b).item() for a, b in zip(whole, sliced))
    _assert_same_state(whole_cache, sliced_cache)


def test_score_rows_keeps_a_slices_scores_within_score_bytes():
    from dsv41_mlx.models.attention import SCORE_BYTES, score_rows

    assert score_rows(8, 32, 131072) == 8  # a decode forward at 128K: whole
    assert score_rows(256, 32, 8192) == 256  # a prefill chunk at 8K: whole
    step = score_rows(256, 32, 32768)
    assert step < 256 and 4 * 32 * 32768 * step <= SCORE_BYTES < 4 * 32 * 32768 * (step + 1)
    assert score_rows(256, 32, 1 << 40) == 1  # at least one row


def test_shared_attention_derives_windows_and_visible_groups_from_host_positions():
    """SharedAttention.window and .visible from positions_of (a view of key_ids'), read back: each row's
    window slots (the buffer rows of its positions, clipped to the rows held), which are
    masked (before the oldest key held, or outside a row's window when rows share the keys),
    and how many compressed groups each row sees; the same for a lazy mx.arange."""
    from dsv41_mlx.models.attention import SharedAttention
    from dsv41_mlx.models.layers import positions_of

    for positions in (positions_of(10, 3), mx.arange(10, 13)):
        shared = SharedAttention()
        # buffer rows 2 .. 9 hold positions 5 .. 12; windows of 4
        index, mask = shared.window(positions, 5, 8, 4, True, 2)
        assert index.dtype == mx.int32 and mask.dtype == mx.bool_
        assert index.tolist() == [[4, 5, 6, 7], [5, 6, 7, 8], [6, 7, 8, 9]]
        assert mask.tolist() == [[True] * 4] * 3
        # keys held from position 9 on (rows 2 ..): the older slots clipped to row 2 and masked
        index, mask = SharedAttention().window(positions, 9, 4, 4, True, 2)
        assert index.tolist() == [[2, 2, 2, 3], [2, 2, 3, 4], [2, 3, 4, 5]]
        assert mask.tolist() == [[False, False, True, True], [False, True, True, True], [True] * 4]
        # rows sharing the keys of positions 8 .. 12: no index, each row's window masked in
        index, mask = SharedAttention().window(positions, 8, 5, 3, False)
        assert index is None
        assert mask.tolist() == [[True, True, True, False, False], [False, True, True, True, False],
                                 [False, False, True, True, True]]
        assert shared.visible(positions, 2).tolist() == [5, 6, 6]
        assert shared.visible(positions, 1).dtype == mx.int32
    # given the positions on the host (Model.__call__), it reads those, not the arrays it is handed
    shared = SharedAttention(positions=np.arange(10, 13))
    index, mask = shared.window(mx.arange(3), 5, 8, 4, True, 2)
    assert index.tolist() == [[4, 5, 6, 7], [5, 6, 7, 8], [6, 7, 8, 9]] and mask.tolist() == [[True] * 4] * 3
    assert shared.visible(mx.arange(3), 2).tolist() == [5, 6, 6]
