"""The embedded default: a small, deterministic checkpoint in the exact release format.

Same tensor names, storage dtypes (FP8 E4M3 + E8M0 tiles, packed FP4 experts,
BF16, F32), sharding and index file as DeepSeek-V4.1's release, DSpark stages
included, with the real tokenizer's 129,280-id vocabulary so text round-trips.
Only the sizes are small and the weights random (seeded per tensor name), so
every code path of the engine runs on any machine in seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..config import ModelArgs
from ..models.engram import bucket_primes
from ..quant import quantize_fp4_rows, quantize_fp8_rows, quantize_fp8_tiles
from ..tokenizer import cache_dir
from .checkpoint import INDEX_FILE, expected_tensors, write_safetensors

log = logging.getLogger("dsv41_mlx")

VERSION = 1  # bump when the config or the weight recipe changes

TINY_TEXT_CONFIG = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 129280,
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 64,
    "o_lora_rank": 32,
    "o_groups": 2,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "rope_theta": 10000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 1024},
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "sliding_window": 16,
    "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0],
    "compress_rope_theta": 160000,
    "kv_source_layer_ids": [2, 4, 5],
    "index_source_layer_ids": [2, 4, 5, 7],
    "index_n_heads": 8,
    "index_head_dim": 64,
    "index_topk": 8,
    "candidate_source_layer_id": 5,
    "candidate_topk_blocks": 2,
    "candidate_block_size": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 4],
    "engram_max_ngram_size": 3,
    "engram_vocab_size": 211,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [5, 6, 7],
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 3,
}


def tiny_config() -> dict:
    """The release config.json layout (root + text_config + quantization_config) of the tiny model."""
    text = dict(TINY_TEXT_CONFIG)
    probe = ModelArgs.from_dict({"model_type": "deepseek_v41", "text_config": {**text, "engram_num_embeddings": [0, 0]}})
    text["engram_num_embeddings"] = [sum(sum(heads) for heads in layer) for layer in bucket_primes(probe)]
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": 129264,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
        "text_config": text,
    }


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """Each tensor's own random generator, from the seed and its name (the bytes then do not
    depend on the order tensors are written in)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def tensor_values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Float values for one tensor, scaled so activations stay O(1) through the stack."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name or leaf in ("q_weight", "k_weight"):
        return 1 + 0.1 * rng.standard_normal(shape)
    if name in ("embed.weight",) or ".markov_head.embed." in name or ".engram.embed." in name:
        return rng.standard_normal(shape)
    if leaf == "attn_sink":
        return rng.standard_normal(shape)
    if leaf.endswith("_base"):
        return 0.5 * rng.standard_normal(shape)
    if leaf.endswith("_scale"):
        return rng.uniform(0.5, 1.5, shape)
    if leaf == "bias":
        return 0.2 * rng.standard_normal(shape)
    gain = 1.5 if (".w1." in name or ".w3." in name) else 2.0 if (".gate." in name or ".wgate." in name) else 1.0
    return gain * rng.standard_normal(shape) / np.sqrt(shape[-1])


def build_checkpoint(out_dir: str | Path, seed: int = 0, config: dict | None = None) -> Path:
    """Write a release-format checkpoint of `config` (default: the tiny model) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = config or tiny_config()
    args = ModelArgs.from_dict(config)
    spec = expected_tensors(args)
    shards: dict[str, dict] = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, (dtype, shape) in spec.items():
        if dtype == "F8_E8M0":
            continue  # written with its weight
        shard = shards["model-00002-of-00002.safetensors" if name.startswith("mtp.") else "model-00001-of-00002.safetensors"]
        rng = tensor_rng(seed, name)
        stem = name[: -len("weight")]
        if dtype == "F8_E4M3":
            w = tensor_values(name, shape, rng)
            codes, scales = quantize_fp8_rows(w) if ".engram.embed." in name else quantize_fp8_tiles(w)
            shard[name] = ("F8_E4M3", codes)
            shard[stem + "scale"] = ("F8_E8M0", scales)
        elif dtype == "I8":  # packed FP4: two inputs per byte
            packed, scales = quantize_fp4_rows(tensor_values(name, (shape[0], shape[1] * 2), rng))
            shard[name] = ("I8", packed)
            shard[stem + "scale"] = ("F8_E8M0", scales)
        else:
            shard[name] = (dtype, tensor_values(name, shape, rng).astype(np.float32).reshape(shape))
    weight_map, total = {}, 0
    for file_name, tensors in shards.items():
        total += write_safetensors(out_dir / file_name, tensors)
        weight_map.update(dict.fromkeys(tensors, file_name))
    (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                  "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def default_checkpoint() -> Path:
    """Path of the embedded default checkpoint, built on first use (atomically)."""
    target = cache_dir() / f"tiny-v{VERSION}"
    if (target / INDEX_FILE).exists():
        return target
    log.info("building the embedded default checkpoint in %s", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        build_checkpoint(tmp)
        os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target
