"""scripts/make_flash_shaped.py: the release's layer structure in the release format, written shard by shard."""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx
import numpy as np

import dsv41_mlx

from .scripts import load_script

SMALL = {"hidden_size": 128, "moe_intermediate_size": 64, "num_attention_heads": 4, "head_dim": 64,
         "qk_rope_head_dim": 16, "q_lora_rank": 64, "o_lora_rank": 32, "o_groups": 2, "index_n_heads": 4,
         "index_head_dim": 64, "index_topk": 8, "candidate_topk_blocks": 4, "engram_head_dim": 32,
         "engram_n_heads": 2, "engram_vocab_size": 211, "dspark_markov_rank": 16}


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
