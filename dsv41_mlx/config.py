"""Model configuration read from a release `config.json`.

The release nests the text model under `text_config` and the storage format
under `quantization_config`; `ModelArgs` flattens both. Field names are the
Hugging Face keys (the reference's own names are noted where they differ).
"""

from __future__ import annotations

import json
import logging
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

log = logging.getLogger("dsv41_mlx")


class ConfigError(ValueError):
    """A config.json that this package cannot run."""


# Keys the release config carries that change nothing here: constants of the
# architecture (one KV head, SiLU, no biases) or training-only settings.
_KNOWN_UNUSED = {
    "model_type",
    "num_key_value_heads",
    "hidden_act",
    "attention_bias",
    "attention_dropout",
    "initializer_range",
    "use_cache",
    "tie_word_embeddings",
    "topk_method",
}
_ROOT_KEYS = {
    "architectures",
    "model_type",
    "dtype",
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "image_token_id",
    "quantization_config",
    "text_config",
    "vision_config",
    "transformers_version",
}
_QUANT_KEYS = {"quant_method", "activation_scheme", "weight_block_size", "scale_fmt", "expert_dtype"}
_ROPE_KEYS = {"rope_type", "type", "factor", "beta_fast", "beta_slow", "original_max_position_embeddings",
              "mscale", "mscale_all_dim"}


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int  # reference: dim
    moe_intermediate_size: int  # reference: moe_inter_dim
    num_hidden_layers: int  # reference: n_layers
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int  # reference: rope_head_dim
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    swiglu_limit: float
    rms_norm_eps: float
    rope_theta: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int  # reference: n_activated_experts
    scoring_func: str
    routed_scaling_factor: float  # reference: route_scale
    sliding_window: int  # reference: window_size
    compress_ratios: list[int]  # one per layer, DSpark stages included
    compress_rope_theta: float
    kv_source_layer_ids: list[int]
    index_source_layer_ids: list[int]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # YaRN (applies to compressed layers only, as in the reference)
    rope_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 0
    max_position_embeddings: int = 0  # the context length; 0 = not stated
    norm_topk_prob: bool = True
    gate_temp: float = 1.0  # no HF key; the release uses the reference default
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    engram_layer_ids: list[int] = field(default_factory=list)
    engram_num_embeddings: list[int] = field(default_factory=list)
    engram_max_ngram_size: int = 1
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 0
    num_nextn_predict_layers: int = 0  # DSpark stages (mtp.*)
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: list[int] = field(default_factory=list)
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    # root / quantization_config
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    weight_block_size: int = 32
    expert_dtype: str = "fp4"
    has_vision: bool = False

    @property
    def has_dspark(self) -> bool:
        return self.num_nextn_predict_layers > 0 and self.dspark_block_size > 0

    @property
    def dspark_feature_dim(self) -> int:
        """Width of the DSpark features: the tapped layers' streams side by side."""
        return len(self.dspark_target_layer_ids) * self.hidden_size

    def moe_shape(self, layer_id: int) -> tuple[int, int]:
        """(routed experts, experts per token) of a backbone layer or DSpark stage."""
        if layer_id < self.num_hidden_layers:
            return self.n_routed_experts, self.num_experts_per_tok
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_num_experts_per_tok or self.num_experts_per_tok)

    def kv_source_of(self, layer_id: int) -> int:
        """The KV-source layer whose compressed KV and index keys `layer_id` reads."""
        sources = [s for s in self.kv_source_layer_ids if s <= layer_id]
        return sources[-1]

    def index_source_of(self, layer_id: int) -> int:
        """The index-source layer whose top-k `layer_id` attends with."""
        sources = [s for s in self.index_source_layer_ids if s <= layer_id]
        return sources[-1]

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        """Flatten a release config (root + text_config + quantization_config)."""
        if not isinstance(config, dict):
            raise ConfigError("config.json must hold a JSON object")
        text = config.get("text_config", config)
        if not isinstance(text, dict):
            raise ConfigError("config.json: text_config must be an object")
        model_type = config.get("model_type", text.get("model_type"))
        if model_type not in ("deepseek_v41", "deepseek_v41_text"):
            raise ConfigError(
                f"config.json: model_type is {model_type!r}; this package runs 'deepseek_v41' only")

        names = {f.name for f in fields(cls)}
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        values: dict = {}
        unknown = []
        for key, value in text.items():
            if text is config and key in _ROOT_KEYS and key not in names:
                continue  # flat config (no text_config): root keys are handled below
            if key == "rope_scaling":
                values.update(_rope_fields(value))
            elif key in names:
                values[key] = value
            elif key not in _KNOWN_UNUSED:
                unknown.append(f"text_config.{key}")
        unknown += [k for k in config if "text_config" in config and k not in _ROOT_KEYS]

        quant = config.get("quantization_config")
        if quant is not None:
            unknown += [f"quantization_config.{k}" for k in quant if k not in _QUANT_KEYS]
            block = quant.get("weight_block_size", [32, 32])
            if list(block) != [32, 32]:
                raise ConfigError(f"config.json: weight_block_size {block} is not supported (release: [32, 32])")
            if quant.get("scale_fmt", "ue8m0") != "ue8m0":
                raise ConfigError(f"config.json: scale_fmt {quant['scale_fmt']!r} is not supported (release: ue8m0)")
            if quant.get("quant_method", "fp8") != "fp8":
                raise ConfigError(f"config.json: quant_method {quant['quant_method']!r} is not supported (release: fp8)")
            values["expert_dtype"] = quant.get("expert_dtype", "fp4")
            if values["expert_dtype"] != "fp4":
                raise ConfigError(f"config.json: expert_dtype {values['expert_dtype']!r} is not supported (release: fp4)")

        if "bos_token_id" in config:
            values["bos_token_id"] = config["bos_token_id"]
        eos = config.get("eos_token_id", text.get("eos_token_id", []))
        values["eos_token_id"] = [eos] if isinstance(eos, int) else list(eos or [])
        values["has_vision"] = "vision_config" in config

        missing = [k for k in required if k not in values]
        if missing:
            raise ConfigError(f"config.json: missing required key text_config.{missing[0]}"
                              + (f" (and {len(missing) - 1} more: {', '.join(missing[1:])})" if len(missing) > 1 else ""))
        if unknown:
            log.warning("config.json: ignoring unknown keys: %s", ", ".join(unknown))
        args = cls(**values)
        args.validate()
        return args

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelArgs":
        path = Path(path)
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot be read ({e})") from None
        return cls.from_dict(config)

    def validate(self) -> None:
        """Cross-field checks that would otherwise fail deep inside a forward pass."""
        n_total = self.num_hidden_layers + self.num_nextn_predict_layers
        if len(self.compress_ratios) != n_total:
            raise ConfigError(f"config.json: compress_ratios has {len(self.compress_ratios)} entries, "
                              f"expected num_hidden_layers + num_nextn_predict_layers = {n_total}")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError("config.json: num_attention_heads must be a multiple of o_groups")
        for layer_id, ratio in enumerate(self.compress_ratios[: self.num_hidden_layers]):
            if ratio and not any(s <= layer_id for s in self.kv_source_layer_ids):
                raise ConfigError(f"config.json: layer {layer_id} compresses KV but no kv_source_layer_ids entry precedes it")
            if ratio and not any(s <= layer_id for s in self.index_source_layer_ids):
                raise ConfigError(f"config.json: layer {layer_id} compresses KV but no index_source_layer_ids entry precedes it")
        for what, ids in (("kv_source_layer_ids", self.kv_source_layer_ids),
                          ("index_source_layer_ids", self.index_source_layer_ids)):
            bad = [i for i in ids if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ConfigError(f"config.json: {what} {bad} are not backbone layers")
        for s in self.kv_source_layer_ids:
            if not self.compress_ratios[s]:
                raise ConfigError(f"config.json: kv source layer {s} has compress ratio 0")
        if len(self.engram_layer_ids) != len(self.engram_num_embeddings):
            raise ConfigError("config.json: engram_layer_ids and engram_num_embeddings differ in length")
        if self.has_dspark:
            bad = [i for i in self.dspark_target_layer_ids if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ConfigError(f"config.json: dspark_target_layer_ids {bad} are not backbone layers")
            if any(self.compress_ratios[self.num_hidden_layers:]):
                raise ConfigError("config.json: DSpark stages must have compress ratio 0")


def _rope_fields(rope: dict) -> dict:
    if not isinstance(rope, dict):
        raise ConfigError("config.json: rope_scaling must be an object")
    unknown = [k for k in rope if k not in _ROPE_KEYS]
    if unknown:
        log.warning("config.json: ignoring unknown rope_scaling keys: %s", ", ".join(unknown))
    return {
        "rope_factor": rope.get("factor", 1.0),
        "beta_fast": rope.get("beta_fast", 32),
        "beta_slow": rope.get("beta_slow", 1),
        "original_max_position_embeddings": rope.get("original_max_position_embeddings", 0),
    }
