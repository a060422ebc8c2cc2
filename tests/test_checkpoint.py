"""Release-format checkpoint reading (and writing) against the tiny reference fixture.

Damaged checkpoints are built in tmp_path from copies of the fixture files; the
fixture itself is never modified.
"""

import json
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dsv41_mlx.io.checkpoint import INDEX_FILE, CheckpointError, check_tensors, expected_tensors, read_header, sanitize, shard_headers, write_safetensors
from dsv41_mlx.io.load import build_model, load
from dsv41_mlx.runtime.options import Options
from dsv41_mlx.runtime.runner import Runner
from dsv41_mlx.config import ModelArgs

FIXTURE = Path(__file__).parent / "fixtures" / "reference-v41-tiny"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
CHECKPOINT_FILES = ("config.json", INDEX_FILE, SHARD1, SHARD2)
N_TENSORS, PAYLOAD_BYTES = 823, 8369464  # README

_NP = {"F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "I8": np.int8, "U8": np.uint8, "BF16": "<u2",
       "F16": "<f2", "F32": "<f4", "I32": "<i4", "I64": "<i8"}


# ------------------------------------------------------------------ helpers


def read_raw(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (dtype, stored array) straight from the bytes (BF16 as uint16 bit patterns)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        data = np.frombuffer(raw[8 + n + begin : 8 + n + end], dtype=_NP[e["dtype"]])
        out[name] = (e["dtype"], data.reshape(e["shape"]))
    return out


def e4m3_values() -> np.ndarray:
    """E4M3 (fn) code -> float64 from the bit layout (sign, 4-bit exponent bias 7, 3-bit mantissa)."""
    b = np.arange(256)
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7))
    v = np.where(b & 0x80, -mag, mag)
    v[(b & 0x7F) == 0x7F] = np.nan
    return v


E4M3 = e4m3_values()
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def copy_checkpoint(tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    target.mkdir()
    for name in CHECKPOINT_FILES:
        shutil.copyfile(FIXTURE / name, target / name)
    return target


def rewrite_shard(model_dir: Path, shard: str, edit) -> None:
    tensors = read_raw(model_dir / shard)
    edit(tensors)
    write_safetensors(model_dir / shard, tensors)


def edit_index(model_dir: Path, edit) -> None:
    index = json.loads((model_dir / INDEX_FILE).read_text())
    edit(index["weight_map"])
    (model_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))


def check(model_dir: Path) -> dict:
    args = ModelArgs.from_file(model_dir / "config.json")
    return check_tensors(args, shard_headers(model_dir))


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    return ModelArgs.from_file(FIXTURE / "config.json")


@pytest.fixture(scope="module")
def fixture_tensors() -> dict[str, tuple[str, np.ndarray]]:
    return {**read_raw(FIXTURE / SHARD1), **read_raw(FIXTURE / SHARD2)}


@pytest.fixture(scope="module")
def loaded():
    return load(FIXTURE)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return copy_checkpoint(tmp_path)


# ------------------------------------------------------- the fixture is clean


def test_expected_tensors_match_the_fixture_exactly(args, fixture_tensors):
    spec = expected_tensors(args)
    assert len(spec) == N_TENSORS
    assert set(spec) == set(fixture_tensors)
    for name, (dtype, array) in fixture_tensors.items():
        assert spec[name] == (dtype, array.shape), name
    assert sum(a.nbytes for _, a in fixture_tensors.values()) == PAYLOAD_BYTES
    # spot checks against the README table
    assert spec["layers.4.engram.embed.weight"] == ("F8_E4M3", (834, 32))
    assert spec["layers.4.engram.embed.scale"] == ("F8_E8M0", (834, 1))
    assert spec["layers.1.engram.wkv.scale"] == ("F8_E8M0", (20, 6))
    assert spec["layers.7.attn.indexer.wq_b.weight"] == ("F8_E4M3", (1024, 64))
    assert "layers.5.attn.compressor.wgate.weight" not in spec  # ratio 1: no gate
    assert "layers.7.attn.compressor.wkv.weight" not in spec  # not a KV source
    assert spec["mtp.1.ffn.experts.3.w2.weight"] == ("I8", (128, 32))
    assert "mtp.1.ffn.experts.4.w2.weight" not in spec  # DSpark stages have 4 experts
    assert spec["mtp.2.confidence_head.proj.weight"] == ("BF16", (1, 144))


def test_check_tensors_on_the_fixture(args):
    where = check_tensors(args, shard_headers(FIXTURE))
    index = json.loads((FIXTURE / INDEX_FILE).read_text())["weight_map"]
    assert len(where) == N_TENSORS
    assert {name: path.name for name, path in where.items()} == index


def test_load_fixture_puts_every_tensor_into_the_model(loaded, fixture_tensors):
    model, tokenizer = loaded
    assert tokenizer is not None
    params = dict(tree_flatten(model.parameters()))
    filled = set()
    n_fp8 = n_fp4 = n_tables = 0
    for name, (dtype, stored) in fixture_tensors.items():
        if ".engram.embed." in name or name.endswith(".scale"):
            continue  # tables: below; scales: checked with their weights
        release_name = name
        # an expert's w1 (gate) and w3 (up) are the even and the odd rows of the model's w13
        gate_up = "experts." in name and name.rsplit(".", 2)[-2] in ("w1", "w3")
        rows = slice(None)
        if gate_up:
            rows = slice(0, None, 2) if name.rsplit(".", 2)[-2] == "w1" else slice(1, None, 2)
        # an attention's wq_a and wkv are the first q_lora_rank rows of the model's wq_a_wkv and the rest
        q_lora = model.args.q_lora_rank
        if ".attn.wq_a." in name or ".attn.wkv." in name:
            rows = slice(0, q_lora) if ".attn.wq_a." in name else slice(q_lora, None)
            name = name.replace(".attn.wq_a.", ".attn.wq_a_wkv.").replace(".attn.wkv.", ".attn.wq_a_wkv.")
        if ".ffn.experts." in name:
            prefix, rest = name.split(".ffn.experts.")
            e, proj, _ = rest.split(".")
            key = f"{prefix}.ffn.experts.{'w13' if gate_up else proj}"
            w, s = params[f"{key}.weight"][int(e)][rows], params[f"{key}.scales"][int(e)][rows]
            got = np.array(mx.dequantize(w, s, mode="mxfp4", dtype=mx.float32))
            scale_codes = fixture_tensors[name[: -len("weight")] + "scale"][1]
            b = stored.view(np.uint8).astype(np.int64)
            values = np.stack([E2M1[b & 0xF], E2M1[b >> 4]], -1).reshape(b.shape[0], -1)
            want = values * np.repeat(2.0 ** (scale_codes.astype(np.float64) - 127), 32, axis=1)
            np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=name)
            filled |= {f"{key}.weight", f"{key}.scales"}
            n_fp4 += 1
        elif dtype == "F8_E4M3":
            scale_codes = fixture_tensors[release_name[: -len("weight")] + "scale"][1]
            tile = np.repeat(np.repeat(2.0 ** (scale_codes.astype(np.float64) - 127), 32, 0), 32, 1)
            want = (E4M3[stored] * tile[: stored.shape[0], : stored.shape[1]]).astype(np.float32)
            key = sanitize(name.replace(".w1.", ".w13.").replace(".w3.", ".w13.") if gate_up else name)
            w = params[key][rows]
            if w.dtype == mx.uint32:  # kept in MLX mxfp8 layout
                scales_key = key[: -len("weight")] + "scales"
                got = np.array(mx.dequantize(w, params[scales_key][rows], mode="mxfp8", dtype=mx.float32))
                filled.add(scales_key)
            else:  # dequantised at load time
                got = np.array(w.astype(mx.float32))
            np.testing.assert_array_equal(got, want, err_msg=release_name)
            filled.add(key)
            n_fp8 += 1
        else:
            key = sanitize(name)
            got = params[key]
            want = bf16_to_f32(stored) if dtype == "BF16" else stored
            if dtype == "BF16" and got.dtype != mx.float32:
                assert got.dtype == mx.bfloat16, name
            np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want, err_msg=name)
            filled.add(key)
    assert n_fp8 == 11 * 8 + 4 + 2 + 1 and n_fp4 == 8 * 8 * 3 + 3 * 4 * 3
    # nothing in the model was left at its initial value
    assert filled == set(params), sorted(set(params) - filled)[:5]
    # the engram tables are the only checkpoint tensors outside the parameter tree
    for layer_id in (1, 4):
        table = model.layers[layer_id].engram.table
        w, s = fixture_tensors[f"layers.{layer_id}.engram.embed.weight"][1], \
            fixture_tensors[f"layers.{layer_id}.engram.embed.scale"][1]
        np.testing.assert_array_equal(np.asarray(table.codes), w)
        np.testing.assert_array_equal(np.asarray(table.scales), s)
        n_tables += 1
    assert n_tables == 2


def test_one_fp8_and_one_fp4_weight_by_hand(loaded, fixture_tensors):
    """The same check, spelled out for `layers.0.attn.wq_a` (FP8, the first rows of wq_a_wkv) and expert 3 of layer 2 (FP4)."""
    model, _ = loaded
    codes = fixture_tensors["layers.0.attn.wq_a.weight"][1]  # [64, 128]
    tiles = fixture_tensors["layers.0.attn.wq_a.scale"][1]  # [2, 4]
    lin = model.layers[0].attn.wq_a_wkv  # wq_a: its first q_lora_rank rows
    got = np.array(mx.dequantize(lin.weight[:64], lin.scales[:64], mode="mxfp8", dtype=mx.float32))
    for r in (0, 31, 32, 63):
        for c in (0, 33, 100, 127):
            assert got[r, c] == E4M3[codes[r, c]] * 2.0 ** (int(tiles[r // 32, c // 32]) - 127)
    assert np.count_nonzero(got) > 0.9 * got.size

    packed = fixture_tensors["layers.2.ffn.experts.3.w1.weight"][1].view(np.uint8)  # [64, 64]
    scales = fixture_tensors["layers.2.ffn.experts.3.w1.scale"][1]  # [64, 4]
    ex = model.layers[2].ffn.experts.w13  # w1's row r is w13's row 2r, w3's the next
    got = np.array(mx.dequantize(ex.weight[3], ex.scales[3], mode="mxfp4", dtype=mx.float32))
    for r in (0, 17, 63):
        for c in (0, 1, 62, 63, 64, 127):
            nibble = packed[r, c // 2] >> 4 if c % 2 else packed[r, c // 2] & 0xF
            assert got[2 * r, c] == E2M1[nibble] * 2.0 ** (int(scales[r, c // 32]) - 127)


def test_engram_tables_stay_memory_mapped(loaded):
    model, _ = loaded
    params = dict(tree_flatten(model.parameters()))
    assert not any(".engram.embed" in k for k in params)
    for layer_id, rows in ((1, 630), (4, 834)):
        table = model.layers[layer_id].engram.table
        assert isinstance(table.codes, np.memmap) and isinstance(table.scales, np.memmap)
        assert table.codes.shape == (rows, 32) and table.scales.shape == (rows, 1)
        assert table.codes.dtype == np.uint8 and table.codes.mode == "r"
        assert Path(table.codes.filename).resolve() == (FIXTURE / SHARD1).resolve()


def test_packed_engram_rows_dequantise_as_each_layers_own(loaded):
    """A forward's engram rows of every layer in one array (engram.pack_rows), dequantised from
    it (unpack_rows): the bits of each layer's rows read and dequantised on their own."""
    from dsv41_mlx.models.engram import dequantize_rows, pack_rows, unpack_rows

    model, _ = loaded
    rng = np.random.default_rng(0)
    ids = {1: rng.integers(0, 630, (3, 16)), 4: rng.integers(0, 834, (3, 16))}
    packed, layout = pack_rows([model.layers[i].engram.table.read(ids[i]) for i in (1, 4)])
    assert packed.dtype == mx.uint8 and packed.ndim == 1
    for i, values in zip((1, 4), unpack_rows(packed, layout)):
        want = dequantize_rows(*(mx.array(a) for a in model.layers[i].engram.table.read(ids[i])))
        assert values.shape == want.shape == (3, 16, 32) and values.dtype == mx.bfloat16
        assert mx.array_equal(values, want).item() and mx.abs(want).max().item() > 0


def test_packed_engram_rows_are_made_up_to_a_padded_forwards_rows_with_zeros(loaded):
    """pack_rows(.., total): rows read for a padded forward's real rows come first in each
    layer's part, the padding rows after them zeros (their values 0); fewer rows than read is an
    error naming both."""
    from dsv41_mlx.models.engram import pack_rows, unpack_rows

    model, _ = loaded
    ids = {1: np.array([[3, 600]]), 4: np.array([[800, 7]])}  # one real row
    packed, layout = pack_rows([model.layers[i].engram.table.read(ids[i]) for i in (1, 4)], 8)
    for i, values in zip((1, 4), unpack_rows(packed, layout)):
        alone = unpack_rows(*pack_rows([model.layers[i].engram.table.read(ids[i])]))[0]
        assert values.shape == (8, 2, 32)
        assert mx.array_equal(values[:1], alone).item() and mx.abs(alone).max().item() > 0
        assert not mx.any(values[1:]).item()
    with pytest.raises(ValueError, match="3 rows read for a forward of 2"):
        pack_rows([model.layers[1].engram.table.read(np.zeros((3, 2), np.int64))], 2)


def test_a_padded_forward_reads_the_engram_tables_for_its_real_rows_only(loaded, monkeypatch):
    """A decode padded to 8 rows looks up its real rows' n-grams alone (a padding row's would be
    8x the table reads, from a memory-mapped file), with the logits, features and cache of a
    forward that is not padded."""
    from dsv41_mlx.models.engram import EngramTable

    model, _ = loaded
    read = []
    real_read = EngramTable.read
    monkeypatch.setattr(EngramTable, "read", lambda self, ids: (read.append(ids.shape), real_read(self, ids))[1])
    ids = list(range(40, 52))
    plain, padded = model.make_cache(), model.make_cache()
    for c in (plain, padded):
        model(mx.array([ids], dtype=mx.int32), c)
    read.clear()
    want, want_f = Runner(model).decode([5, 9], plain)
    assert read and all(shape[0] == 2 for shape in read)
    read.clear()
    got, got_f = Runner(model, Options(decode_rows=8)).decode([5, 9], padded)
    assert read and all(shape[0] == 2 for shape in read)
    assert mx.array_equal(want, got).item() and mx.array_equal(want_f, got_f).item()
    assert plain.tokens == padded.tokens


def test_load_of_a_copied_checkpoint_matches(tmp_path, loaded):
    model, _ = load(copy_checkpoint(tmp_path))
    ref = dict(tree_flatten(loaded[0].parameters()))
    got = dict(tree_flatten(model.parameters()))
    assert set(got) == set(ref)
    for k in ("layers.3.attn.wq_b.weight", "mtp.0.main_proj.scales", "embed.weight", "layers.6.hc_ffn.fn"):
        assert mx.array_equal(got[k], ref[k]).item(), k


# ------------------------------------------------------------- damaged files
# Messages are checked with the temporary directory cut out (pytest names it
# after the test, and test names contain words like "truncated" or "missing").


def error(call, where: Path) -> str:
    """Run call(where), expect CheckpointError, return its message with `where` replaced by <dir>."""
    with pytest.raises(CheckpointError) as e:
        call(where)
    return str(e.value).replace(str(where), "<dir>")


def errors(where: Path) -> list[str]:
    """The messages of both entry points: check_tensors(shard_headers(...)) and load(...)."""
    return [error(check, where), error(load, where)]


def test_truncated_shard(ckpt):
    path = ckpt / SHARD1
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    for msg in errors(ckpt):
        assert f"<dir>/{SHARD1}" in msg and "truncated" in msg


def test_shard_truncated_inside_its_header(ckpt):
    path = ckpt / SHARD2
    path.write_bytes(path.read_bytes()[:4000])
    msg = error(check, ckpt)
    assert f"<dir>/{SHARD2}" in msg and "truncated" in msg


@pytest.mark.parametrize(
    "offset, junk",
    [(8, b"\xff\xfe\x00garbage\x81" * 4),  # not UTF-8
     (40, b"}}}]]]" * 5),  # UTF-8 but not JSON
     (0, b"\x13\x37\xde\xad\xbe\xef\x00\x01")],  # the header length itself
)
def test_garbled_header(ckpt, offset, junk):
    path = ckpt / SHARD2
    data = bytearray(path.read_bytes())
    data[offset : offset + len(junk)] = junk
    path.write_bytes(bytes(data))
    for msg in errors(ckpt):
        assert f"<dir>/{SHARD2}" in msg and "corrupt" in msg and "truncated" not in msg


def test_header_entry_with_bad_fields(tmp_path):
    def raw_file(header, payload: bytes) -> Path:
        text = json.dumps(header).encode()
        path = tmp_path / f"f{len(list(tmp_path.iterdir()))}.safetensors"
        path.write_bytes(struct.pack("<Q", len(text)) + text + payload)
        return path

    ok = raw_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    assert read_header(ok) == {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    cases = [
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "8 bytes of data"),
        ({"a": {"dtype": "F32", "shape": ["two"], "data_offsets": [0, 8]}}, "corrupt"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, "corrupt"),
        ({"a": {"dtype": "F32", "shape": [2]}}, "corrupt"),
        ({"a": {"dtype": "Q3", "shape": [2], "data_offsets": [0, 8]}}, "unsupported dtype Q3"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "truncated"),
        ([1, 2], "corrupt"),  # JSON, but not an object
    ]
    for header, word in cases:
        path = raw_file(header, bytes(8))
        msg = error(read_header, path)
        assert msg.startswith("<dir>") and word in msg, (header, msg)


def test_missing_shard_file(ckpt):
    (ckpt / SHARD2).unlink()
    for msg in errors(ckpt):
        assert f"<dir>/{SHARD2}" in msg and "missing" in msg


def test_wrong_shape(ckpt):
    name = "layers.0.attn.wq_a.weight"

    def edit(t):
        dtype, a = t[name]
        t[name] = (dtype, a[:-1])

    rewrite_shard(ckpt, SHARD1, edit)
    for msg in errors(ckpt):
        assert name in msg and f"<dir>/{SHARD1}" in msg
        assert "[63, 128]" in msg and "expected F8_E4M3[64, 128]" in msg


def test_wrong_dtype(ckpt):
    def edit(t):
        t["norm.weight"] = ("F32", bf16_to_f32(t["norm.weight"][1]))

    rewrite_shard(ckpt, SHARD1, edit)
    msg = error(check, ckpt)
    assert "tensor norm.weight is F32[128], expected BF16[128]" in msg and f"<dir>/{SHARD1}" in msg


def test_fp8_weight_stored_as_int8(ckpt):
    name = "mtp.0.main_proj.weight"
    rewrite_shard(ckpt, SHARD2, lambda t: t.update({name: ("I8", t[name][1].view(np.int8))}))
    msg = error(check, ckpt)
    assert f"{name} is I8[128, 384], expected F8_E4M3[128, 384]" in msg and f"<dir>/{SHARD2}" in msg


def test_missing_tensor(ckpt):
    name = "layers.3.ffn.shared_experts.w2.scale"
    rewrite_shard(ckpt, SHARD1, lambda t: t.pop(name))
    edit_index(ckpt, lambda m: m.pop(name))
    for msg in errors(ckpt):
        assert f"missing tensor {name}" in msg and "more" not in msg


def test_several_missing_tensors_are_counted(ckpt):
    names = [n for n in read_raw(FIXTURE / SHARD2) if n.startswith("mtp.2.")]

    def drop(d):
        for n in names:
            d.pop(n)

    rewrite_shard(ckpt, SHARD2, drop)
    edit_index(ckpt, drop)
    msg = error(check, ckpt)
    assert "missing tensor mtp.2." in msg and f"and {len(names) - 1} more" in msg


@pytest.mark.parametrize("name, dtype, value", [
    ("layers.0.attn.bogus_bias", "F32", np.zeros(4, np.float32)),
    ("layers.8.attn_norm.weight", "BF16", np.ones(128, np.float32)),  # a layer the config lacks
    ("mtp.1.ffn.experts.4.w1.scale", "F8_E8M0", np.full((64, 4), 127, np.uint8)),  # 5th DSpark expert
])
def test_unexpected_tensor(ckpt, name, dtype, value):
    rewrite_shard(ckpt, SHARD2, lambda t: t.update({name: (dtype, value)}))
    edit_index(ckpt, lambda m: m.update({name: SHARD2}))
    for msg in errors(ckpt):
        assert f"unexpected tensor {name}" in msg and f"<dir>/{SHARD2}" in msg


def test_index_points_at_the_wrong_shard(ckpt):
    edit_index(ckpt, lambda m: m.update({"norm.weight": SHARD2}))
    for msg in errors(ckpt):
        assert f"<dir>/{SHARD2}: does not hold norm.weight" in msg and INDEX_FILE in msg


def test_index_lists_a_tensor_no_shard_holds(ckpt):
    name = "layers.6.ffn.gate.bias"
    rewrite_shard(ckpt, SHARD1, lambda t: t.pop(name))
    msg = error(check, ckpt)
    assert f"<dir>/{SHARD1}: does not hold {name}" in msg


def test_tensor_in_two_shards(ckpt):
    name = "layers.2.attn.attn_sink"
    rewrite_shard(ckpt, SHARD2, lambda t: t.update({name: read_raw(FIXTURE / SHARD1)[name]}))
    msg = error(check, ckpt)
    assert name in msg and "also appears" in msg


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', '{"weight_map": ["a"]}'])
def test_broken_index(ckpt, text):
    (ckpt / INDEX_FILE).write_text(text)
    msg = error(check, ckpt)
    assert f"<dir>/{INDEX_FILE}: not a valid safetensors index" in msg


def test_vision_tensors_are_skipped_only_with_a_vision_tower(ckpt):
    extra = {"vision.blocks.0.norm.weight": ("BF16", np.ones(8, np.float32)),
             "layers.0.ffn.gate.bias_vl": ("F32", np.zeros(8, np.float32))}
    rewrite_shard(ckpt, SHARD2, lambda t: t.update(extra))
    edit_index(ckpt, lambda m: m.update({k: SHARD2 for k in extra}))
    assert "unexpected tensor" in error(check, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["vision_config"] = {}
    (ckpt / "config.json").write_text(json.dumps(config))
    where = check(ckpt)
    assert len(where) == N_TENSORS and not set(extra) & set(where)


def test_single_file_checkpoint(tmp_path, fixture_tensors):
    target = tmp_path / "single"
    target.mkdir()
    shutil.copyfile(FIXTURE / "config.json", target / "config.json")
    write_safetensors(target / "model.safetensors", fixture_tensors)
    where = check(target)
    assert len(where) == N_TENSORS and set(where.values()) == {target / "model.safetensors"}
    (target / "model.safetensors").unlink()
    assert "no model.safetensors" in error(check, target)


# --------------------------------------------------------- write_safetensors


@pytest.mark.parametrize("shard", [SHARD1, SHARD2])
def test_write_safetensors_reproduces_the_fixture_shards(tmp_path, shard):
    out = tmp_path / shard
    write_safetensors(out, read_raw(FIXTURE / shard))
    assert out.read_bytes() == (FIXTURE / shard).read_bytes()


def test_write_safetensors_layout(tmp_path):
    path = tmp_path / "t.safetensors"
    rng = np.random.default_rng(0)
    tensors = {
        "z.codes": ("F8_E4M3", rng.integers(0, 256, (3, 32), dtype=np.uint8)),
        "b.scale": ("F8_E8M0", np.array([[120, 127]], np.uint8)),
        "a.packed": ("I8", rng.integers(0, 256, (2, 5), dtype=np.uint8)),  # uint8 taken as raw bytes
        "m.norm": ("BF16", np.array([1.0, -2.5, 3.0e-3], np.float32)),
        "c.f32": ("F32", rng.standard_normal((2, 3))),  # float64 in, F32 out
        "y.ids": ("I64", np.array([1, -2, 2**40])),
        "x.i32": ("I32", np.array([[7]], np.int16)),
        "s.scalar": ("F32", np.float32(1.5)),
    }
    write_safetensors(path, tensors, metadata={"source": "test"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and len(raw) == 8 + n + 96 + 10 + 6 + 24 + 24 + 4 + 2 + 4
    header = json.loads(raw[8 : 8 + n])
    assert list(header) == ["__metadata__"] + sorted(tensors)
    assert header["__metadata__"] == {"format": "pt", "source": "test"}
    assert header["s.scalar"]["shape"] == [] and header["a.packed"]["dtype"] == "I8"
    # data: widest dtypes first, names in order within a dtype, contiguous from 0
    spans = sorted((e["data_offsets"], k) for k, e in header.items() if k != "__metadata__")
    assert [k for _, k in spans] == ["y.ids", "c.f32", "s.scalar", "x.i32", "m.norm",
                                     "b.scale", "z.codes", "a.packed"]
    assert spans[0][0][0] == 0 and all(a[0][1] == b[0][0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][0][1] == len(raw) - 8 - n
    # read back: by our reader, by the package, by MLX, by the safetensors library
    back = read_raw(path)
    np.testing.assert_array_equal(back["z.codes"][1], tensors["z.codes"][1])
    np.testing.assert_array_equal(back["a.packed"][1].view(np.uint8), tensors["a.packed"][1])
    np.testing.assert_array_equal(back["c.f32"][1], tensors["c.f32"][1].astype(np.float32))
    assert back["y.ids"][1].tolist() == [1, -2, 2**40] and back["x.i32"][1].tolist() == [[7]]
    assert back["m.norm"][1].tolist() == [0x3F80, 0xC020, 0x3B45]  # 3e-3 is 0x3B449BA6: rounds up
    assert set(read_header(path)) == set(tensors)
    arrays = mx.load(str(path))
    assert arrays["m.norm"].dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(arrays["m.norm"].astype(mx.float32)), bf16_to_f32(back["m.norm"][1]))
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": "pt", "source": "test"}
        assert sorted(f.keys()) == sorted(tensors)
        np.testing.assert_array_equal(f.get_tensor("c.f32"), tensors["c.f32"][1].astype(np.float32))
        np.testing.assert_array_equal(f.get_tensor("y.ids"), [1, -2, 2**40])


def test_write_safetensors_bf16_rounds_to_nearest_even(tmp_path):
    f32 = lambda bits: np.array(bits, np.uint32).view(np.float32)  # noqa: E731
    # exact ties round to the even bf16 mantissa, anything past the tie rounds up
    cases = {
        0x3F800000: 0x3F80,  # 1.0
        0x3F808000: 0x3F80,  # tie, even stays
        0x3F818000: 0x3F82,  # tie, odd rounds up
        0x3F808001: 0x3F81,  # past the tie
        0x3F807FFF: 0x3F80,  # below the tie
        0xBF818000: 0xBF82,  # negative tie
        0x7F7FFFFF: 0x7F80,  # float32 max rounds to inf
        0x7F800000: 0x7F80,  # inf
        0xFF800000: 0xFF80,  # -inf
        0x00000001: 0x0000,  # smallest subnormal -> +0
        0x00018000: 0x0002,  # subnormal tie, odd rounds up
        0x80000000: 0x8000,  # -0
    }
    values = f32(list(cases))
    rng = np.random.default_rng(1)
    rand = (rng.standard_normal(5000) * 10.0 ** rng.uniform(-30, 30, 5000)).astype(np.float32)
    nans = f32([0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF])
    path = tmp_path / "bf16.safetensors"
    write_safetensors(path, {"cases": ("BF16", values), "rand": ("BF16", rand), "nan": ("BF16", nans)})
    back = read_raw(path)
    assert back["cases"][1].tolist() == list(cases.values())
    want = np.array(mx.array(rand).astype(mx.bfloat16).view(mx.uint16))  # MLX casts with RNE
    np.testing.assert_array_equal(back["rand"][1], want)
    assert np.all(np.isnan(bf16_to_f32(back["nan"][1])))
    assert np.signbit(bf16_to_f32(back["nan"][1])).tolist() == [False, False, True, False]
    # uint16 input is taken as raw bit patterns
    write_safetensors(path, {"raw": ("BF16", np.array([0x1234, 0xFFFF], np.uint16))})
    assert read_raw(path)["raw"][1].tolist() == [0x1234, 0xFFFF]


@pytest.mark.parametrize("dtype, array", [
    ("F8_E4M3", np.zeros(4, np.float32)),  # codes must be uint8
    ("F8_E8M0", np.zeros(4, np.int8)),
    ("I8", np.zeros(4, np.int32)),
    ("BF16", np.zeros(4, np.int32)),
    ("I32", np.array([2**40])),  # does not fit
    ("F64", np.zeros(4)),  # not a release dtype
])
def test_write_safetensors_rejects_mismatched_arrays(tmp_path, dtype, array):
    path = tmp_path / "bad.safetensors"
    with pytest.raises(ValueError, match="bad_tensor"):
        write_safetensors(path, {"bad_tensor": (dtype, array)})


def test_write_safetensors_rejects_reserved_name_and_bad_metadata(tmp_path):
    with pytest.raises(ValueError):
        write_safetensors(tmp_path / "a", {"__metadata__": ("F32", np.zeros(1))})
    with pytest.raises(ValueError):
        write_safetensors(tmp_path / "b", {"x": ("F32", np.zeros(1))}, metadata={"n": 3})


def test_a_checkpoint_larger_than_memory_is_refused_with_both_numbers(ckpt, monkeypatch):
    import dsv41_mlx.io.checkpoint as checkpoint
    import dsv41_mlx.io.load as loading

    monkeypatch.setattr(loading, "machine_memory", lambda: 1_000_000)
    headers = shard_headers(ckpt)
    args = ModelArgs.from_file(ckpt / "config.json")
    needed = checkpoint.resident_bytes(headers, check_tensors(args, headers), checkpoint.declared_floats(build_model(args)))
    msg = error(load, ckpt)
    assert f"weights need {needed / 1e6:.1f} MB" in msg and "this machine has 1.0 MB" in msg


def test_resident_bytes_leave_out_the_memory_mapped_engram_tables(ckpt):
    import dsv41_mlx.io.checkpoint as checkpoint

    headers = shard_headers(ckpt)
    where = check_tensors(ModelArgs.from_file(ckpt / "config.json"), headers)
    everything = sum(e["data_offsets"][1] - e["data_offsets"][0] for h in headers.values() for e in h.values())
    tables = sum(e["data_offsets"][1] - e["data_offsets"][0] for h in headers.values() for n, e in h.items()
                 if ".engram.embed." in n)
    assert tables > 0 and checkpoint.resident_bytes(headers, where) == everything - tables


def test_bf16_tensors_the_model_computes_in_fp32_are_widened_once_and_counted_so(ckpt):
    """The head, the routers and the ratio > 1 compressors are used in fp32 on every call:
    they are widened at load (exactly) and the memory check counts them at that width."""
    import dsv41_mlx.io.checkpoint as checkpoint

    model, _ = load(ckpt)
    headers = shard_headers(ckpt)
    where = check_tensors(model.args, headers)
    params = dict(tree_flatten(model.parameters()))
    widened = [n for n in where if headers[where[n]][n]["dtype"] == "BF16" and params[sanitize(n)].dtype == mx.float32]
    assert {"layers.0.ffn.gate.weight", "layers.2.attn.compressor.wkv.weight",
            "layers.2.attn.compressor.wgate.weight"} <= set(widened)
    ratio_1 = "layers.5.attn.compressor.wkv.weight"
    assert ratio_1 in where and ratio_1 not in widened  # ratio 1: a bf16 projection
    assert params["head.weight"].dtype == mx.bfloat16  # kept as stored: model.Head reads it so
    extra = 0
    for name in widened:
        stored = mx.load(str(where[name]))[name]
        assert mx.array_equal(stored.astype(mx.float32), params[sanitize(name)]).item(), name
        extra += stored.nbytes
    declared = checkpoint.declared_floats(build_model(model.args))
    assert checkpoint.resident_bytes(headers, where, declared) == checkpoint.resident_bytes(headers, where) + extra
