"""scripts/decode_growth.py: a decode step's attention per layer role at the release's sizes,
and the indexer's pieces, at a context past the indexers' free picks."""

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
