"""scripts/make_flash_shaped.py: the release's layer structure in the release format, written shard by shard."""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx
import numpy as np

import dsv41_mlx

from .scripts import load_script

# the script's small widths, with few picks and candidate blocks, so that a short prompt scores
SMALL = {**load_script("make_flash_shaped").SMALL_DIMS, "index_topk": 8, "candidate_topk_blocks": 4}


def test_release_config_has_the_release_layout():
    config = load_script("make_flash_shaped").flash_config()["text_config"]
    args = dsv41_mlx.config.ModelArgs.from_dict({"model_type": "deepseek_v41", "text_config": config})
    assert (args.num_hidden_layers, args.hidden_size, args.num_attention_heads, args.head_dim) == (40, 5120, 64, 512)
    assert args.compress_ratios == [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    assert args.moe_shape(0) == (24, 6) and args.moe_shape(40) == (16, 3)


def test_small_flash_shaped_checkpoint_loads_and_runs(tmp_path):
    script = load_script("make_flash_shaped")
    config = script.flash_config(experts=4, top=2, dspark_experts=4, dspark_top=2, dims=SMALL)
    written = script.write_checkpoint(tmp_path, config, log=lambda *_: None)
    assert len(list(tmp_path.glob("model-*.safetensors"))) == 40 + 3 + 2  # one shard per layer / stage, the embedding, the head
    model, _ = dsv41_mlx.load(tmp_path)
    logits, features = model(mx.array([[5, 6, 7, 8]], dtype=mx.int32))
    assert np.isfinite(np.array(logits)).all() and features.shape == (1, 4, 3 * 128)
    assert written == sum(p.stat().st_size for p in tmp_path.glob("*.safetensors")) - sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for p in tmp_path.glob("*.safetensors"))


def test_parallel_writers_write_the_same_bytes(tmp_path):
    script = load_script("make_flash_shaped")
    config = script.flash_config(experts=4, top=2, dspark_experts=4, dspark_top=2, dims=SMALL)
    for jobs in (1, 3):
        script.write_checkpoint(tmp_path / f"jobs{jobs}", config, log=lambda *_: None, jobs=jobs)

    def digests(d: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    assert digests(tmp_path / "jobs1") == digests(tmp_path / "jobs3")


def test_small_option_keeps_the_release_layout_at_tiny_widths(tmp_path, monkeypatch):
    """`make_flash_shaped.py --small`: the release's layers, compress / source / candidate layout,
    window and picks (what count_ops counts for the release), at the tiny widths."""
    script = load_script("make_flash_shaped")
    monkeypatch.setattr("sys.argv", ["make_flash_shaped.py", str(tmp_path), "--small", "--experts", "4", "--top", "2",
                                     "--dspark-experts", "4", "--dspark-top", "2", "--jobs", "1"])
    assert script.main() == 0
    model, _ = dsv41_mlx.load(tmp_path)
    args = model.args
    assert (args.num_hidden_layers, args.hidden_size, args.head_dim) == (40, 128, 64)
    assert args.compress_ratios == [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    assert (args.kv_source_layer_ids, args.index_source_layer_ids) == ([2, 8, 14, 20], [2, 8, 14, 20, 24, 28, 32, 36])
    assert (args.sliding_window, args.index_topk, args.candidate_topk_blocks) == (128, 512, 2048)
