import copy
import json
import logging
from pathlib import Path

import pytest

from dsv41_mlx.config import ConfigError, ModelArgs

FIXTURE = Path(__file__).parent / "fixtures" / "reference-v41-tiny"


@pytest.fixture(scope="module")
def raw_config() -> dict:
    return json.loads((FIXTURE / "config.json").read_text())


@pytest.fixture
def cfg(raw_config) -> dict:
    return copy.deepcopy(raw_config)


def _warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING]


def test_fixture_config_parses_to_reference_values(caplog):
    caplog.set_level(logging.WARNING, logger="dsv41_mlx")
    args = ModelArgs.from_file(FIXTURE / "config.json")
    assert _warnings(caplog) == []  # every key of the release layout is known
    # text_config scalars (README ModelArgs table, HF names)
    assert args.vocab_size == 8192
    assert args.hidden_size == 128
    assert args.moe_intermediate_size == 64
    assert args.num_hidden_layers == 8
    assert args.num_nextn_predict_layers == 3
    assert args.num_attention_heads == 4
    assert args.head_dim == 64 and args.qk_rope_head_dim == 16
    assert args.rms_norm_eps == 1e-20
    assert args.routed_scaling_factor == 1.5
    assert args.sliding_window == 8
    assert args.compress_ratios == [0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0]
    assert args.kv_source_layer_ids == [2, 4, 5]
    assert args.index_source_layer_ids == [2, 4, 5, 7]
    assert args.engram_layer_ids == [1, 4] and args.engram_num_embeddings == [630, 834]
    assert args.engram_pad_token_id == 2
    assert args.dspark_num_experts_per_tok == 3
    assert args.gate_temp == 1.0 and args.norm_topk_prob is True
    # rope_scaling -> flat YaRN fields
    assert args.rope_factor == 4
    assert args.beta_fast == 32 and args.beta_slow == 1
    assert args.original_max_position_embeddings == 32
    assert args.rope_theta == 10000 and args.compress_rope_theta == 160000
    # root section: a scalar eos id becomes a list
    assert args.bos_token_id == 0
    assert args.eos_token_id == [1]
    assert args.expert_dtype == "fp4"
    assert args.has_vision is False
    assert args.has_dspark is True
    # derived helpers
    assert args.moe_shape(0) == (8, 2)
    assert args.moe_shape(8) == (4, 3)  # DSpark stage
    assert [args.kv_source_of(i) for i in (2, 3, 4, 5, 6, 7)] == [2, 2, 4, 5, 5, 5]
    assert [args.index_source_of(i) for i in (2, 3, 4, 5, 6, 7)] == [2, 2, 4, 5, 5, 7]


def test_eos_list_and_no_dspark(cfg):
    cfg["eos_token_id"] = [1, 7]
    cfg["text_config"]["num_nextn_predict_layers"] = 0
    cfg["text_config"]["compress_ratios"] = cfg["text_config"]["compress_ratios"][:8]
    args = ModelArgs.from_dict(cfg)
    assert args.eos_token_id == [1, 7]
    assert args.has_dspark is False


def test_eos_in_text_config_is_kept_when_root_has_none(cfg):
    del cfg["eos_token_id"]
    cfg["text_config"]["eos_token_id"] = 5
    assert ModelArgs.from_dict(cfg).eos_token_id == [5]


def test_missing_required_key_is_named(cfg):
    del cfg["text_config"]["hidden_size"]
    with pytest.raises(ConfigError, match=r"hidden_size") as e:
        ModelArgs.from_dict(cfg)
    assert "text_config.hidden_size" in str(e.value)


def test_several_missing_keys_are_all_named(cfg):
    del cfg["text_config"]["hidden_size"]
    del cfg["text_config"]["index_topk"]
    with pytest.raises(ConfigError) as e:
        ModelArgs.from_dict(cfg)
    assert "hidden_size" in str(e.value) and "index_topk" in str(e.value)


def test_unknown_key_logs_one_warning_naming_it(cfg, caplog):
    cfg["text_config"]["frobnication_depth"] = 3
    caplog.set_level(logging.WARNING, logger="dsv41_mlx")
    args = ModelArgs.from_dict(cfg)
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "frobnication_depth" in message and "\n" not in message
    assert args.hidden_size == 128  # still parsed


def test_unknown_root_and_quant_keys_share_one_warning(cfg, caplog):
    cfg["mystery_root"] = 1
    cfg["quantization_config"]["mystery_quant"] = 2
    caplog.set_level(logging.WARNING, logger="dsv41_mlx")
    ModelArgs.from_dict(cfg)
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert "mystery_root" in warnings[0].getMessage()
    assert "quantization_config.mystery_quant" in warnings[0].getMessage()


def test_flat_config_without_text_config(cfg, caplog):
    flat = {k: v for k, v in cfg.items() if k != "text_config"}
    flat.update(cfg["text_config"])
    flat["model_type"] = "deepseek_v41"
    caplog.set_level(logging.WARNING, logger="dsv41_mlx")
    args = ModelArgs.from_dict(flat)
    assert args.hidden_size == 128 and args.eos_token_id == [1] and args.rope_factor == 4
    assert _warnings(caplog) == []  # root keys are not "unknown text_config keys"


@pytest.mark.parametrize("where", ["root", "text"])
def test_other_model_type_is_rejected(cfg, where):
    if where == "root":
        cfg["model_type"] = "llama"
    else:
        del cfg["model_type"]
        cfg["text_config"]["model_type"] = "llama"
    with pytest.raises(ConfigError, match="llama"):
        ModelArgs.from_dict(cfg)


def test_invalid_json_file_names_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "deepseek_v41", "text_config": {')
    with pytest.raises(ConfigError) as e:
        ModelArgs.from_file(path)
    assert str(path) in str(e.value)


def test_binary_garbage_file_names_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00\x81garbage\x9c")
    with pytest.raises(ConfigError) as e:
        ModelArgs.from_file(path)
    assert str(path) in str(e.value)


def test_missing_file_names_path(tmp_path):
    path = tmp_path / "nope" / "config.json"
    with pytest.raises(ConfigError) as e:
        ModelArgs.from_file(path)
    assert str(path) in str(e.value)


def test_non_object_config_is_rejected(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2, 3]")
    with pytest.raises(ConfigError):
        ModelArgs.from_file(path)


@pytest.mark.parametrize("ratios", [[0, 0, 2, 2, 2, 1, 1, 1], [0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0, 0]])
def test_compress_ratios_of_wrong_length(cfg, ratios):
    cfg["text_config"]["compress_ratios"] = ratios
    with pytest.raises(ConfigError, match=r"compress_ratios has %d entries.*11" % len(ratios)):
        ModelArgs.from_dict(cfg)


@pytest.mark.parametrize(
    "key, value, pattern",
    [
        ("kv_source_layer_ids", [2, 4, 11], r"kv_source_layer_ids \[11\]"),
        ("index_source_layer_ids", [2, 4, 5, 9], r"index_source_layer_ids \[9\]"),
        ("kv_source_layer_ids", [1, 4, 5], r"kv source layer 1 has compress ratio 0"),
        ("kv_source_layer_ids", [4, 5], r"layer 2 compresses KV but no kv_source"),
        ("dspark_target_layer_ids", [5, 6, 8], r"dspark_target_layer_ids \[8\]"),
        ("engram_num_embeddings", [630], r"engram_layer_ids and engram_num_embeddings"),
        ("o_groups", 3, r"multiple of o_groups"),
    ],
)
def test_inconsistent_fields_raise(cfg, key, value, pattern):
    cfg["text_config"][key] = value
    with pytest.raises(ConfigError, match=pattern):
        ModelArgs.from_dict(cfg)


def test_dspark_stage_with_compression_is_rejected(cfg):
    cfg["text_config"]["compress_ratios"][-1] = 2
    with pytest.raises(ConfigError, match="DSpark"):
        ModelArgs.from_dict(cfg)


@pytest.mark.parametrize(
    "key, value, word",
    [("weight_block_size", [128, 128], "weight_block_size"), ("scale_fmt", "fp32", "scale_fmt"),
     ("quant_method", "awq", "quant_method"), ("expert_dtype", "fp8", "expert_dtype")],
)
def test_unsupported_quantization_is_rejected(cfg, key, value, word):
    cfg["quantization_config"][key] = value
    with pytest.raises(ConfigError, match=word):
        ModelArgs.from_dict(cfg)


def test_vision_config_sets_has_vision(cfg):
    cfg["vision_config"] = {"num_hidden_layers": 32}
    assert ModelArgs.from_dict(cfg).has_vision is True
