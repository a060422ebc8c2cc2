"""scripts/pipeline_split.py: the release's default split and each rank's resident bytes."""

from __future__ import annotations

from .scripts import load_script


def test_the_release_split_covers_every_layer_and_adds_up():
    table = load_script("pipeline_split").split_table([2, 3], experts=24)
    for ranks, rows in table["splits"].items():
        assert len(rows) == ranks and rows[0][0] == 0 and rows[-1][1] == 40
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))  # contiguous
        assert sum(n for *_, n in rows) == table["total"]
        # a rank starts only where no later layer reads an earlier rank's compressed KV or top-k
        assert {a for a, *_ in rows[1:]} <= {1, 2, 8, 14, 20}
