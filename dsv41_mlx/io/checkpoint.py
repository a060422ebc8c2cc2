"""Reading release checkpoints: sharded safetensors in DeepSeek-V4.1's storage format.

Storage (names are the reference's state_dict names, no `model.` prefix):
  FP8 linear  `X.weight` F8_E4M3 [out, in] + `X.scale` F8_E8M0 [ceil(out/32), ceil(in/32)]
  FP4 expert  `X.weight` I8 [out, in/2] (E2M1 pairs, low nibble first) + `X.scale` F8_E8M0 [out, in/32]
  engram table `embed.weight` F8_E4M3 [rows, d] + `embed.scale` F8_E8M0 [rows, d/32] (memory-mapped)
  everything else BF16 or F32.

Loading is strict: every tensor the config implies must be present with the
right dtype and shape, and every tensor present must be used (vision tensors
of a release with a vision tower are listed and skipped). Weights stay in
release precision: FP8 and FP4 bits are repacked, never dequantised.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tqdm import tqdm

from ..config import ModelArgs
from ..kernels.specs import fp8_tiles_to_mx
from ..models.engram import EngramTable
from ..quant import fp4_rows_to_mx

log = logging.getLogger("dsv41_mlx")

INDEX_FILE = "model.safetensors.index.json"
_DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}
_VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or is damaged."""


# ---------------------------------------------------------------- the contract

def _ceil32(n: int) -> int:
    return -(-n // 32)


def expected_tensors(args: ModelArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor a release checkpoint of this config holds: name -> (dtype, shape)."""
    spec: dict[str, tuple[str, tuple[int, ...]]] = {}
    dim, hc = args.hidden_size, args.hc_mult

    def fp8(name, out_dim, in_dim):
        spec[f"{name}.weight"] = ("F8_E4M3", (out_dim, in_dim))
        spec[f"{name}.scale"] = ("F8_E8M0", (_ceil32(out_dim), _ceil32(in_dim)))

    def fp4(name, out_dim, in_dim):
        spec[f"{name}.weight"] = ("I8", (out_dim, in_dim // 2))
        spec[f"{name}.scale"] = ("F8_E8M0", (out_dim, in_dim // 32))

    def bf16(name, *shape):
        spec[name] = ("BF16", tuple(shape))

    def f32(name, *shape):
        spec[name] = ("F32", tuple(shape))

    def block(p, layer_id):
        heads, hd = args.num_attention_heads, args.head_dim
        f32(f"{p}.attn.attn_sink", heads)
        fp8(f"{p}.attn.wq_a", args.q_lora_rank, dim)
        bf16(f"{p}.attn.q_norm.weight", args.q_lora_rank)
        fp8(f"{p}.attn.wq_b", heads * hd, args.q_lora_rank)
        fp8(f"{p}.attn.wkv", hd, dim)
        bf16(f"{p}.attn.kv_norm.weight", hd)
        fp8(f"{p}.attn.wo_a", args.o_groups * args.o_lora_rank, heads * hd // args.o_groups)
        fp8(f"{p}.attn.wo_b", dim, args.o_groups * args.o_lora_rank)
        backbone = layer_id < args.num_hidden_layers
        if backbone and layer_id in args.kv_source_layer_ids:
            bf16(f"{p}.attn.compressor.wkv.weight", hd, dim)
            if args.compress_ratios[layer_id] > 1:
                bf16(f"{p}.attn.compressor.wgate.weight", hd, dim)
            bf16(f"{p}.attn.compressor.norm.weight", hd)
            bf16(f"{p}.attn.indexer.wk.weight", args.index_head_dim, hd)
            bf16(f"{p}.attn.indexer.k_norm.weight", args.index_head_dim)
        if backbone and layer_id in args.index_source_layer_ids:
            fp8(f"{p}.attn.indexer.wq_b", args.index_n_heads * args.index_head_dim, args.q_lora_rank)
            bf16(f"{p}.attn.indexer.weights_proj.weight", args.index_n_heads, dim)
        bf16(f"{p}.attn_norm.weight", dim)
        bf16(f"{p}.ffn_norm.weight", dim)
        for part in ("attn", "ffn"):
            f32(f"{p}.hc_{part}_fn", (2 + hc) * hc, hc * dim)
            f32(f"{p}.hc_{part}_base", (2 + hc) * hc)
            f32(f"{p}.hc_{part}_scale", 3)
        n_experts, _ = args.moe_shape(layer_id)
        inter = args.moe_intermediate_size
        bf16(f"{p}.ffn.gate.weight", n_experts, dim)
        f32(f"{p}.ffn.gate.bias", n_experts)
        for e in range(n_experts):
            fp4(f"{p}.ffn.experts.{e}.w1", inter, dim)
            fp4(f"{p}.ffn.experts.{e}.w2", dim, inter)
            fp4(f"{p}.ffn.experts.{e}.w3", inter, dim)
        fp8(f"{p}.ffn.shared_experts.w1", inter, dim)
        fp8(f"{p}.ffn.shared_experts.w2", dim, inter)
        fp8(f"{p}.ffn.shared_experts.w3", inter, dim)

    bf16("embed.weight", args.vocab_size, dim)
    bf16("head.weight", args.vocab_size, dim)
    bf16("norm.weight", dim)
    for i in range(args.num_hidden_layers):
        block(f"layers.{i}", i)
        if i in args.engram_layer_ids:
            rows = args.engram_num_embeddings[args.engram_layer_ids.index(i)]
            d = args.engram_head_dim
            n_cols = (args.engram_max_ngram_size - 1) * args.engram_n_heads
            spec[f"layers.{i}.engram.embed.weight"] = ("F8_E4M3", (rows, d))
            spec[f"layers.{i}.engram.embed.scale"] = ("F8_E8M0", (rows, d // 32))
            fp8(f"layers.{i}.engram.wkv", dim * (hc + 1), n_cols * d)
            bf16(f"layers.{i}.engram.q_weight", hc, dim)
            bf16(f"layers.{i}.engram.k_weight", hc, dim)
    if args.has_dspark:
        last = args.num_nextn_predict_layers - 1
        for k in range(args.num_nextn_predict_layers):
            p = f"mtp.{k}"
            block(p, args.num_hidden_layers + k)
            if k == 0:
                fp8(f"{p}.main_proj", dim, args.dspark_feature_dim)
                bf16(f"{p}.main_norm.weight", dim)
            if k == last:
                bf16(f"{p}.norm.weight", dim)
                bf16(f"{p}.markov_head.embed.weight", args.vocab_size, args.dspark_markov_rank)
                bf16(f"{p}.markov_head.head.weight", args.vocab_size, args.dspark_markov_rank)
                bf16(f"{p}.confidence_head.proj.weight", 1, dim + args.dspark_markov_rank)
    return spec


def is_ignored(name: str, args: ModelArgs) -> bool:
    """Tensors of parts this package does not build (the vision tower and its routing bias)."""
    return args.has_vision and (name.startswith(_VISION_PREFIXES) or name.endswith(".gate.bias_vl"))


# ------------------------------------------------------------- reading shards

def read_header(path: Path) -> dict[str, dict]:
    """Parse and check one safetensors header against the file's size.

    Returns name -> {"dtype", "shape", "data_offsets"}. A short, truncated or
    garbled file raises CheckpointError naming it.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise CheckpointError(f"{path}: corrupt safetensors header (claims {n} header bytes, file has {size})")
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors header "
                                  f"(claims {n} header bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not all(type(v) is int for v in (*shape, begin, end)) or any(d < 0 for d in shape):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {name}") from None
        if dtype not in _DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        count = 1
        for d in shape:
            count *= d
        if end - begin != count * _DTYPE_BYTES[dtype] or begin < 0:
            raise CheckpointError(f"{path}: tensor {name} {dtype}{list(shape)} has {end - begin} bytes of data")
        if end > data_size:
            raise CheckpointError(f"{path}: truncated: tensor {name} ends at byte {end} "
                                  f"of the data section but the file holds only {data_size}")
    return header


# ------------------------------------------------------------- writing shards

_WRITE_ORDER = ("I64", "F32", "I32", "BF16", "F16", "F8_E8M0", "F8_E4M3", "I8", "U8")  # data layout order


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float -> bfloat16 bit patterns (uint16), round-to-nearest-even; NaN stays a (quiet) NaN."""
    f = np.ascontiguousarray(values, dtype=np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def _storage_bytes(name: str, dtype: str, array: np.ndarray) -> np.ndarray:
    """The little-endian storage array of one tensor (same shape as `array`)."""
    a = np.asarray(array)
    kind = a.dtype.kind
    if dtype == "BF16":
        if a.dtype == np.uint16:
            return a.astype("<u2")  # already bf16 bit patterns
        if kind == "f":
            return _bf16_bits(a).astype("<u2")
    elif dtype in ("F32", "F16"):
        if kind in "fiu":
            return a.astype("<f4" if dtype == "F32" else "<f2")
    elif dtype in ("F8_E4M3", "F8_E8M0", "U8"):
        if a.dtype == np.uint8:
            return a
    elif dtype == "I8":
        if a.dtype in (np.int8, np.uint8):
            return a.view(np.int8)
    elif dtype in ("I32", "I64"):
        if kind in "iu":
            out = a.astype("<i4" if dtype == "I32" else "<i8")
            if not np.array_equal(out, a):
                raise ValueError(f"{name}: values do not fit {dtype}")
            return out
    else:
        raise ValueError(f"{name}: cannot write dtype {dtype!r} (supported: {', '.join(_WRITE_ORDER)})")
    raise ValueError(f"{name}: cannot store a numpy {a.dtype} array as {dtype}")


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, tuple[str, np.ndarray]],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write one safetensors file: `tensors` maps name -> (safetensors dtype, numpy array).
    Returns the payload size in bytes (what an index's `metadata.total_size` adds up).

    What each dtype takes:
      BF16              float arrays, rounded to nearest even in numpy bit arithmetic
                        (no ml_dtypes needed); a uint16 array is taken as raw bf16 bits
      F32 / F16         float (or integer) arrays, cast
      F8_E4M3, F8_E8M0  uint8 code arrays (E4M3 codes, E8M0 exponent bytes), stored as is
      U8                uint8 arrays
      I8                int8 arrays, or uint8 arrays reinterpreted (packed FP4 experts)
      I32 / I64         integer arrays (values must fit)
    The shape of each array is the tensor's shape. The file is laid out as the
    `safetensors` library lays it out (the release shards and the fixture are
    byte-identical to this writer's output): header `__metadata__` first
    ({"format": "pt"} plus `metadata`, string values only), then the tensor
    entries with keys in sorted order; data grouped by dtype, widest first
    (I64, F32, I32, BF16, F16, F8_E8M0, F8_E4M3, I8, U8) and by name within a
    dtype, so every tensor is aligned to its element size; the header is
    space-padded to a multiple of 8 bytes.
    """
    meta = {"format": "pt", **(metadata or {})}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError("safetensors metadata must map strings to strings")
    if "__metadata__" in tensors:
        raise ValueError("'__metadata__' is not a valid tensor name")
    data = {}
    for name, (dtype, array) in tensors.items():
        data[name] = (dtype, _storage_bytes(name, dtype, array))
    entries: dict[str, dict] = {}
    blobs = []
    offset = 0
    for name in sorted(data, key=lambda n: (_WRITE_ORDER.index(data[n][0]), n)):
        dtype, stored = data[name]
        raw = np.ascontiguousarray(stored).tobytes()
        entries[name] = {"data_offsets": [offset, offset + len(raw)], "dtype": dtype,
                         "shape": [int(d) for d in stored.shape]}
        blobs.append(raw)
        offset += len(raw)
    header = {"__metadata__": meta, **{name: entries[name] for name in sorted(entries)}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)
    return offset


def local_model_dir(path_or_repo: str | os.PathLike) -> Path | None:
    """The local checkpoint directory path_or_repo names, or None where it is a Hugging Face repo
    id (owner/name) to download; CheckpointError where it is neither. Nothing is downloaded."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path}: expected a checkpoint directory")
        return path
    text = str(path_or_repo)
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise CheckpointError(f"{text}: no such directory, and not a Hugging Face repo id (owner/name)")
    return None


def resolve_model_dir(path_or_repo: str | os.PathLike) -> Path:
    """A local checkpoint directory, or a Hugging Face repo id downloaded with snapshot_download."""
    local = local_model_dir(path_or_repo)
    if local is not None:
        return local
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path_or_repo), allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))


def shard_headers(model_dir: Path) -> dict[Path, dict[str, dict]]:
    """Headers of every shard the index names (or of model.safetensors alone)."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map must map tensor names to file names")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
    elif (model_dir / "model.safetensors").exists():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise CheckpointError(f"{model_dir}: no {INDEX_FILE} and no model.safetensors")
    headers = {}
    for name in files:
        path = model_dir / name
        if not path.exists():
            raise CheckpointError(f"{path}: shard listed in {INDEX_FILE} is missing")
        headers[path] = read_header(path)
    if weight_map is not None:
        for tensor, shard in weight_map.items():
            if tensor not in headers[model_dir / shard]:
                raise CheckpointError(f"{model_dir / shard}: does not hold {tensor}, which {INDEX_FILE} places there")
    return headers


def checkpoint_digest(model_dir: Path) -> bytes:
    """sha256 of what names a checkpoint's contents: config.json and the safetensors index (or a
    lone model.safetensors's header), for ranks of a pipeline to check they read the same one."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    index = model_dir / INDEX_FILE
    if index.exists():
        digest.update(index.read_bytes())
    else:
        with open(model_dir / "model.safetensors", "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(n))
    return digest.digest()


def check_tensors(args: ModelArgs, headers: dict[Path, dict[str, dict]]) -> dict[str, Path]:
    """Match the shards against `expected_tensors`; return name -> file for the tensors to load."""
    expected = expected_tensors(args)
    where: dict[str, Path] = {}
    ignored = 0
    for path, header in headers.items():
        for name, entry in header.items():
            if name in where:
                raise CheckpointError(f"{path}: tensor {name} also appears in {where[name]}")
            if name not in expected:
                if is_ignored(name, args):
                    ignored += 1
                    continue
                raise CheckpointError(f"{path}: unexpected tensor {name} {entry['dtype']}{entry['shape']} "
                                      "(not part of this config's model)")
            dtype, shape = expected[name]
            if entry["dtype"] != dtype or tuple(entry["shape"]) != shape:
                raise CheckpointError(f"{path}: tensor {name} is {entry['dtype']}{list(entry['shape'])}, "
                                      f"expected {dtype}{list(shape)}")
            where[name] = path
    missing = [n for n in expected if n not in where]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]}{more}")
    if ignored:
        log.info("skipping %d vision tensors (no vision tower is built)", ignored)
    return where


FLOAT_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


def resident_bytes(headers: dict[Path, dict[str, dict]], where: dict[str, Path],
                   declared: dict[str, mx.Dtype] | None = None) -> int:
    """Bytes the loaded weights occupy in memory: every tensor to load but the engram
    tables, which stay memory-mapped on disk; a float tensor the model declares wider
    (`declared_floats`) counts at that width, as load_weights widens it."""
    total = 0
    for name, path in where.items():
        if ".engram.embed." in name:
            continue
        entry = headers[path][name]
        start, end = entry["data_offsets"]
        dtype = (declared or {}).get(sanitize(name))
        stored = FLOAT_BYTES.get(entry["dtype"])
        total += (end - start) // stored * dtype.size if dtype and stored and dtype.size > stored else end - start
    return total


def machine_memory() -> int:
    """Bytes of memory the weights can live in: the GPU's on Metal, physical RAM elsewhere."""
    if mx.metal.is_available():
        return int(mx.device_info()["memory_size"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def size_text(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def check_memory(needed: int, available: int, model_dir: Path) -> None:
    if needed > available:
        raise CheckpointError(f"{model_dir}: its weights need {size_text(needed)} of memory (engram tables are "
                              f"memory-mapped and not counted) and this machine has {size_text(available)}")


# ------------------------------------------------------------ into the model

def sanitize(name: str) -> str:
    """Release name -> this package's parameter name (same module tree, MLX-layout fields)."""
    for part in ("attn", "ffn"):
        for field in ("fn", "base", "scale"):
            if name.endswith(f".hc_{part}_{field}"):
                return name[: -len(f"hc_{part}_{field}")] + f"hc_{part}.{field}"
    if name.endswith(".scale"):
        return name[: -len(".scale")] + ".scales"
    return name


def declared_floats(model) -> dict[str, mx.Dtype]:
    """Each floating-point parameter of the model with the dtype the model declares for it."""
    return {name: v.dtype for name, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}


def stack_gate_up(params: dict[str, mx.array]) -> None:
    """Replace each expert projection pair w1 (gate) and w3 (up), routed stacks and shared
    experts alike, by w13: their rows interleaved (w1's row p, then w3's row p), so that one
    GEMM makes both (model.Fp4Experts, model.Expert) and a GEMV kernel's thread group holds
    the gate and up rows of its outputs side by side (kernels.swiglu_pairs). Exact: each
    output is its own row of weights (and scales)."""
    for name in [n for n in params if ".w1." in n and "experts." in n]:
        gate, up = params.pop(name), params.pop(name.replace(".w1.", ".w3."))
        pairs = mx.stack([gate, up], axis=-2)  # [..., out, 2, cols]
        params[name.replace(".w1.", ".w13.")] = pairs.reshape(*gate.shape[:-2], 2 * gate.shape[-2], gate.shape[-1])


def stack_wq_a_wkv(params: dict[str, mx.array]) -> None:
    """Replace each attention's wq_a and wkv (target layers and DSpark stages; FP8 weights and
    their scales) by wq_a_wkv: wq_a's rows, then wkv's, so that one GEMM makes both
    (model.Attention, Fp8Linear.quantized_pair). Exact: each output is its own row of
    weights and scales, and a product of either part reads a view of those rows."""
    for name in [n for n in params if ".attn.wq_a." in n]:
        kv_name = name.replace(".attn.wq_a.", ".attn.wkv.")
        params[name.replace(".attn.wq_a.", ".attn.wq_a_wkv.")] = mx.concatenate(
            [params.pop(name), params.pop(kv_name)], axis=0)


def load_weights(model, model_dir: Path, where: dict[str, Path], progress: bool = False) -> None:
    """Load every checked tensor into `model`, repacking FP8/FP4 into MLX layouts, and
    attach the engram tables as memory maps. progress: a tqdm bar over the blocks."""
    shards = {}
    for path in sorted(set(where.values())):
        try:
            shards[path] = mx.load(str(path))  # lazy: tensors are read when evaluated
        except Exception as e:  # MLX raises bare RuntimeError/ValueError on damaged files
            raise CheckpointError(f"{path}: cannot be read ({e})") from None

    def tensor(name):
        return shards[where[name]][name]

    params: dict[str, mx.array] = {}
    experts: dict[str, dict[int, mx.array]] = defaultdict(dict)
    for name in where:
        if ".engram.embed." in name or name.endswith(".scale"):
            continue  # tables are memory-mapped below; scales travel with their weights
        t = tensor(name)
        if ".ffn.experts." in name:
            prefix, rest = name.split(".ffn.experts.")
            e, proj, _ = rest.split(".")
            stem = f"{prefix}.ffn.experts.{proj}"
            experts[f"{stem}.weight"][int(e)] = fp4_rows_to_mx(t)
            experts[f"{stem}.scales"][int(e)] = tensor(name[: -len("weight")] + "scale")
        elif t.dtype == mx.uint8:  # FP8 linear
            scale_name = name[: -len("weight")] + "scale"
            params[sanitize(name)], params[sanitize(scale_name)] = fp8_tiles_to_mx(t, tensor(scale_name))
        else:
            params[sanitize(name)] = t
    for name, per_expert in experts.items():
        params[name] = mx.stack([per_expert[e] for e in range(len(per_expert))])
    stack_gate_up(params)
    stack_wq_a_wkv(params)
    # a float tensor the model declares wider than the file stores it (the router's gate, the
    # compressors' projections: fp32 math on every call) is widened once here, exactly,
    # rather than on every call
    for name, dtype in declared_floats(model).items():
        t = params.get(name)
        if t is not None and mx.issubdtype(t.dtype, mx.floating) and dtype.size > t.dtype.size:
            params[name] = t.astype(dtype)
    model.load_weights(list(params.items()), strict=True)
    # (a pipeline rank's model holds some of them: runtime.pipeline.StageModel)
    parts = [p for p in (model.embed, *model.layers, *model.mtp, model.norm, model.head)
             if p is not None and p.parameters()]
    for part in tqdm(parts, desc="loading weights", unit="block", disable=not progress):
        mx.eval(part.parameters())  # reads this block's tensors from the shards

    for i, layer in enumerate(model.layers):
        if hasattr(layer, "engram"):
            w, s = f"layers.{i}.engram.embed.weight", f"layers.{i}.engram.embed.scale"
            layer.engram.table = EngramTable.from_safetensors(where[w], w, s)
