"""scripts/decode_growth.py: a decode step's attention per layer role at the release's sizes,
and the indexer's pieces, at a context past the indexers' free picks."""

import mlx.core as mx

from .scripts import load_script


def test_attention_is_timed_per_layer_role_and_indexer_piece(capsys):
    growth = load_script("decode_growth")
    (row,) = growth.attention_rows([600], rows=1, reps=1)  # 600 groups at ratio 1: past index_topk 512
    assert row["context"] == 600
    roles = [f"layer {i}" for i in growth.ROLES]
    assert set(row) == {"context", *roles, "index scores", "top-k", "gather picks", "append one group"}
    assert all(row[k] > 0 for k in row)
    growth.print_tables([], [row], "cpu")
    out = capsys.readouterr().out
    assert "| context | " + " | ".join(roles) in out and "| 600 | " in out


def forward_reads(c) -> tuple[list, list]:
    """What a forward reads of a layer's cache: the ends, the window's last `window` rows, and a
    KV source's pooled kv, index keys and unfinished group's raw rows."""
    w = c.window
    ends, arrays = [w.end], [w.keys[-min(w.window, w.end):]]
    if c.compressor is not None:
        ends.append(c.compressor.end)
        arrays += [c.compressor.kv, c.compressor.index_keys, c.compressor.pending()]
    return ends, arrays


def test_padded_forwards_leave_every_cache_as_filled(monkeypatch):
    """The GPU's decode forward: 8 rows, 1 of them real, each row gathering its own window. Each
    repetition starts from the filled caches, and leaves them (every layer's, run or not) as
    they were."""
    growth = load_script("decode_growth")
    filled = []
    fill = growth.filled_caches

    def recorded(*args):
        caches = fill(*args)
        filled.append((caches, [c.copy() for c in caches]))
        return caches

    monkeypatch.setattr(growth, "filled_caches", recorded)
    (row,) = growth.attention_rows([600], rows=8, reps=1, row_invariant=True)
    assert all(row[k] > 0 for k in row)
    ((caches, before),) = filled
    for c, b in zip(caches, before):
        (ends, arrays), (ends_before, arrays_before) = forward_reads(c), forward_reads(b)
        assert ends == ends_before
        assert [a is None for a in arrays] == [a is None for a in arrays_before]
        assert all(mx.array_equal(a, a0).item() for a, a0 in zip(arrays, arrays_before) if a is not None)
