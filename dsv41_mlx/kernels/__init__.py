"""Custom kernels (docs/kernels.md is the catalogue).

Each kernel exists three ways, and one wrapper here picks:

* `mx.fast.metal_kernel` on Metal (Macs): body in `metal_kernels/<name>.metal`;
* `mx.fast.cuda_kernel` on CUDA: body in `metal_kernels/<name>.cu`, the same
  algorithm line for line;
* pure MLX everywhere else (the CPU): the `*_reference` functions, which are
  the specification both kernels are tested against.

rows_gate, which computes nothing (it holds a forward's launches until the host has
written their rows), is the one kernel with a CUDA text only.

The bodies share `fp8_common.h` (integer bit tricks valid in both languages).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from .specs import Fp8Matrix, fp8_fake_quant_reference

TOP_K = 64  # candidates the drafter keeps per position
TILE = 256  # outputs per threadgroup in fp8_rows (fixed in the kernel text)
MAX_ROWS = 16


def _kernel_dir() -> Path:
    """metal_kernels/ of a source checkout, else the copy installed beside the package."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package.parent / "metal_kernels", package / "metal_kernels"):
        if (candidate / "fp8_rows.metal").exists():
            return candidate
    raise FileNotFoundError(f"metal_kernels/ not found next to {package}")


def kernel_text(filename: str) -> str:
    return (_kernel_dir() / filename).read_text()


def device_backend() -> str:
    """'metal', 'cuda' or 'mlx' (the CPU): what the default device runs on."""
    return _gpu_language() if mx.default_device() == mx.gpu else "mlx"


@lru_cache(maxsize=None)
def _gpu_language() -> str:
    """'metal' or 'cuda' where this process has that GPU, else 'mlx': asked once (a forward
    asks device_backend for every kernel it launches)."""
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "mlx"


def backend() -> str:
    """'metal', 'cuda' or 'mlx' (pure MLX): what the kernels run on for the default device.
    DSV41_MLX_KERNELS=0 in the environment runs the pure-MLX specs on a GPU too (to compare
    or time the two: scripts/bench.py profile, once with it and once without)."""
    return "mlx" if kernels_switched_off() else device_backend()


@lru_cache(maxsize=None)
def kernels_switched_off() -> bool:
    """DSV41_MLX_KERNELS=0, read once a process: a decode step asks backend ~230 times, too
    often to read the environment each time."""
    return os.environ.get("DSV41_MLX_KERNELS", "1") == "0"


@dataclass(frozen=True)
class KernelSpec:
    """Everything MLX needs to build one kernel, for either language."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    metal: str | None  # body file; None: the kernel runs on CUDA only
    cuda: str
    header_files: tuple[str, ...] = ("fp8_common.h",)
    twin_headers: tuple[str, ...] = ()  # a .h for Metal and a .cuh for CUDA each
    end: str = ""  # a body's end shared by kernels with one start: `{end}.metal` / `{end}.cu` appended

    def header(self, language: str) -> str:
        files = list(self.header_files) + (["fp16_bits.cuh", "mma_c.cuh"] if language == "cuda" else [])
        files += [f"{name}.cuh" if language == "cuda" else f"{name}.h" for name in self.twin_headers]
        return "\n".join(kernel_text(f) for f in files)

    def source(self, language: str) -> str:
        text = kernel_text(self.metal if language == "metal" else self.cuda)
        return text + kernel_text(f"{self.end}.{'metal' if language == 'metal' else 'cu'}") if self.end else text


FP8_ROWS = KernelSpec("fp8_rows_top64", ("x", "w", "scales"), ("top_vals", "top_ids"),
                      "fp8_rows.metal", "fp8_rows.cu")
# Sizes that change from call to call (rows, counts) are int32 inputs, not template
# constants: each template combination is a separate build (seconds on CUDA).
RING_WRITE = KernelSpec("ring_write", ("rings", "rows", "span"), ("out",), "ring_write.metal", "ring_write.cu",
                        header_files=())
ACT_QUANT = KernelSpec("act_quant_fp8", ("x", "n"), ("y",), "act_quant.metal", "act_quant.cu", header_files=(),
                       twin_headers=("fp8_lane",))
HC_SPLIT = KernelSpec("hc_split", ("mixes", "scale", "base", "eps", "rows"), ("pre", "post", "comb"),
                      "hc_split.metal", "hc_split.cu", header_files=(), twin_headers=("hc_split_row",))
MOE_GATE_SCORES = KernelSpec("moe_gate_scores", ("x", "w", "params", "sizes"), ("scores",),
                             "moe_gate_scores.metal", "moe_gate_scores.cu", header_files=())
MOE_GATE_TOPK = KernelSpec("moe_gate_topk", ("scores", "bias", "params", "rows"), ("weights", "ids"),
                           "moe_gate_topk.metal", "moe_gate_topk.cu", header_files=())
SPARSE_ATTENTION = KernelSpec("sparse_attention", ("q", "ring", "index", "wmask", "kv", "ids", "pmask", "sink",
                                                  "rope_cos", "rope_sin", "params", "rows"),
                              ("out",), "sparse_attention.metal", "sparse_attention.cu", header_files=(),
                              twin_headers=("bf16_lane",))
RMS_NORM = KernelSpec("rms_norm_rows", ("x", "w", "eps", "sizes", "rope_cos", "rope_sin"), ("y",), "rms_norm.metal",
                      "rms_norm.cu", header_files=(), twin_headers=("fp8_lane", "rms_norm_row"))
RMS_NORM_PAIR = KernelSpec("rms_norm_pair", ("x", "w", "x2", "w2", "eps", "sizes", "rope_cos", "rope_sin"),
                           ("y", "y2"), "rms_norm_pair.metal", "rms_norm_pair.cu", header_files=(),
                           twin_headers=("fp8_lane", "rms_norm_row"))
FP4_QUANT = KernelSpec("fp4_quant", ("x", "n"), ("y",), "fp4_quant.metal", "fp4_quant.cu", header_files=())
HC_MIX = KernelSpec("hc_mix", ("h", "fn", "rows"), ("parts",), "hc_mix.metal", "hc_mix.cu", header_files=(),
                    twin_headers=("hc_mix_sum",))
HC_POST_MIX = KernelSpec("hc_post_mix", ("y", "residual", "post", "comb", "fn", "rows"), ("parts", "h"),
                         "hc_post_mix.metal", "hc_post_mix.cu", header_files=(), twin_headers=("hc_expand", "hc_mix_sum"))
HC_INPUT = KernelSpec("hc_input", ("h", "pre_in", "parts", "scale", "base", "norm_w", "params", "rows"),
                      ("x", "xq", "pre", "post", "comb"), "hc_input.metal", "hc_input.cu", header_files=(),
                      twin_headers=("hc_split_lanes", "fp8_lane"))
FP8_GEMV = KernelSpec("fp8_gemv", ("x", "w", "scales", "sizes", "swiglu", "parts"), ("y",), "fp8_gemv.metal",
                      "fp8_gemv.cu", twin_headers=("fp8_lane", "bf16_lane", "gemv_lane"))
FP8_MMA = KernelSpec("fp8_mma", ("x", "w", "scales", "sizes", "swiglu", "parts", "after"), ("y",), "fp8_mma.metal",
                     "fp8_mma.cu", twin_headers=("fp8_lane", "bf16_lane", "gemv_lane", "mma_x"), end="fp8_mma_y")
# fp8_mma whose output goes straight into the hyper-connection stream (fp8_mma_hc.metal)
FP8_MMA_HC = KernelSpec("fp8_mma_hc", ("x", "w", "scales", "sizes", "parts", "residual", "post", "comb", "fn"),
                        ("h", "mix_parts"), "fp8_mma.metal", "fp8_mma.cu",
                        twin_headers=("fp8_lane", "bf16_lane", "gemv_lane", "mma_x", "hc_expand"), end="fp8_mma_hc")
HEAD_LOGITS = KernelSpec("head_logits", ("x", "w", "sizes"), ("y",), "head_logits.metal", "head_logits.cu",
                         header_files=(), twin_headers=("bf16_lane",))
FP4_EXPERTS = KernelSpec("fp4_experts", ("x", "xs", "w", "scales", "ids", "sizes", "swiglu", "weights"), ("y",),
                         "fp4_experts.metal", "fp4_experts.cu", twin_headers=("fp8_lane", "bf16_lane", "gemv_lane", "mma_x"))
MMA_X_PREP = KernelSpec("mma_x_prep", ("x", "sizes"), ("xh", "xs"), "mma_x_prep.metal", "mma_x_prep.cu",
                        twin_headers=("fp8_lane", "bf16_lane", "gemv_lane", "mma_x"))
ROWS_GATE = KernelSpec("rows_gate", ("flag", "rows"), ("status", "out"), None, "rows_gate.cu", header_files=())


@lru_cache(maxsize=None)
def _compiled(spec: KernelSpec, language: str):
    """spec's kernel for `language`. MLX 0.32's CUDA backend hashes a custom kernel's whole text
    (its header and body, 2-12 KB here) every time it launches it, to name the kernel's module:
    a visible share of a decode step's host time. So on CUDA the texts reach NVRTC through
    `#include` of a copy on disk (included_texts), and a launch hashes two short lines."""
    make = mx.fast.metal_kernel if language == "metal" else mx.fast.cuda_kernel
    header, source = spec.header(language), spec.source(language)
    if language == "cuda":
        header, source = included_texts(spec.name, header, source)
    return make(name=spec.name, input_names=list(spec.inputs), output_names=list(spec.outputs),
                source=source, header=header)


def kernel_text_cache() -> Path:
    """Where included_texts writes its copies: the package's cache directory
    (`$DSV41_MLX_CACHE`, else `~/.cache/dsv41_mlx`), not a shared temporary one, where
    another user could change a copy between its check and NVRTC's read."""
    from ..tokenizer import cache_dir

    return cache_dir() / "cuda-kernels"


def included_texts(name: str, header: str, source: str, root: Path | None = None) -> tuple[str, str]:
    """(header, source) as two `#include` lines of copies written once under
    root/<digest of both texts>/ (root: kernel_text_cache()): changed texts are new files, a
    new kernel name and a new build. The texts themselves where the copies cannot be written
    or their path cannot stand in an #include."""
    try:
        root = root or kernel_text_cache()
    except RuntimeError:  # no home directory to be found (Path.home)
        return header, source
    folder = root / hashlib.sha256(f"{header}\0{source}".encode()).hexdigest()[:24]
    files = {folder / f"{name}.cuh": header, folder / f"{name}.cu": source}
    if any(c in str(folder) for c in '"\\\n') or not str(folder).isascii():
        return header, source
    try:
        for path, text in files.items():
            if not path.exists() or path.read_text() != text:
                folder.mkdir(parents=True, exist_ok=True, mode=0o700)
                part = path.with_suffix(f".{os.getpid()}.part")
                part.write_text(text)
                os.replace(part, path)  # another process may write the same copy: either is whole
    except OSError:
        return header, source
    return tuple(f'#include "{path}"\n' for path in files)


@lru_cache(maxsize=4096)
def _constant(dtype: mx.Dtype, *values) -> mx.array:
    """A kernel's small argument (sizes, row counts, epsilons: a few values per model), made
    and evaluated once per value and shared by every later call, so that a forward allocates
    no argument arrays on the host (on CUDA, MLX's allocator may hand a host allocation a
    device buffer from its cache and copy it to managed memory, which waits for the device)."""
    a = mx.array(values, dtype=dtype)
    mx.eval(a)
    return a


def _int32s(*values: int) -> mx.array:
    return _constant(mx.int32, *values)


def _float32s(*values: float) -> mx.array:
    return _constant(mx.float32, *values)


# -------------------------------------------------------------------- fp8_rows

def fp8_rows_reference(x: mx.array, w: Fp8Matrix) -> tuple[mx.array, mx.array]:
    """Pure-MLX spec: logits = x @ dequant(w)^T in float32, then the TOP_K best per row.

    x [R, K] -> (values [R, TOP_K] float32, best first; ids [R, TOP_K] int32)."""
    logits = x.astype(mx.float32) @ w.dequantize().T
    return _best(logits, mx.broadcast_to(mx.arange(logits.shape[1], dtype=mx.int32), logits.shape))


def _best(values: mx.array, ids: mx.array) -> tuple[mx.array, mx.array]:
    """The TOP_K largest of values [R, n] with their ids, best first."""
    part = mx.argpartition(-values, kth=TOP_K - 1, axis=-1)[:, :TOP_K]
    vals = mx.take_along_axis(values, part, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(vals, order, axis=-1), mx.take_along_axis(mx.take_along_axis(ids, part, axis=-1),
                                                                        order, axis=-1)


def fp8_rows_tiles(x: mx.array, w: Fp8Matrix, language: str,
                   init_value: float | None = None) -> tuple[mx.array, mx.array]:
    """The kernel alone: per 256-output tile, each row's 64 best (values, ids) [R, tiles, 64].
    init_value poisons the outputs before the launch (for checks)."""
    R, K = x.shape
    N = w.shape[0]
    tiles = -(-N // TILE)
    xb = x if x.dtype == mx.bfloat16 else x.astype(mx.bfloat16)  # the drafter's activations are bf16 already
    kernel = _compiled(FP8_ROWS, language)
    vals, ids = kernel(inputs=[xb.view(mx.uint16), w.codes, w.scales],
                       template=[("R", R), ("K", K), ("N", N), ("TILES", tiles)],
                       grid=(tiles * TILE, 1, 1), threadgroup=(TILE, 1, 1),
                       output_shapes=[(R, tiles, TOP_K), (R, tiles, TOP_K)],
                       output_dtypes=[mx.float32, mx.int32], init_value=init_value)
    return vals, ids


def fp8_rows_top64(x: mx.array, w: Fp8Matrix, impl: str | None = None) -> tuple[mx.array, mx.array]:
    """x [R, K] (R <= 16) through the FP8 matrix; the 64 best outputs per row, best first.

    The kernel reads bf16 activations as they are (the drafter's are); x of another dtype is
    rounded to bf16 for it, where the spec takes x as it is.
    impl: 'metal', 'cuda' or 'mlx' (default: `backend()`)."""
    R, K = x.shape
    N = w.shape[0]
    if not 1 <= R <= MAX_ROWS:
        raise ValueError(f"fp8_rows takes 1..{MAX_ROWS} rows, got {R}")
    if K % 128 or N % 32 or N < TOP_K:
        raise ValueError(f"fp8_rows needs K a multiple of 128, N of 32, and N >= {TOP_K}; got N={N}, K={K}")
    impl = impl or backend()
    if impl == "mlx":
        return fp8_rows_reference(x, w)
    vals, ids = fp8_rows_tiles(x, w, impl)
    return _best(vals.reshape(R, -1), ids.reshape(R, -1))


# ------------------------------------------------------------------ ring_write

def ring_write_reference(rings: mx.array, rows: mx.array, first: int) -> mx.array:
    """Pure-MLX spec: rings [S, W, D] with rows [S, M, D] (positions first..first+M-1, M <= W)
    written to slots position % W."""
    W = rings.shape[1]
    slots = mx.arange(first, first + rows.shape[1]) % W
    out = mx.array(rings)
    out[:, slots] = rows
    return out


def ring_write(rings: mx.array, rows: mx.array, first: int, impl: str | None = None) -> mx.array:
    """One launch for all stages: the rings after writing rows at positions first.. (see the reference)."""
    S, W, D = rings.shape
    M = rows.shape[1]
    if rows.shape[0] != S or rows.shape[2] != D or not 1 <= M <= W:
        raise ValueError(f"ring_write: rows {rows.shape} do not fit rings {rings.shape}")
    impl = impl or backend()
    if impl == "mlx" or D % 8:
        return ring_write_reference(rings, rows, first)
    kernel = _compiled(RING_WRITE, impl)
    total = S * W * (D // 8)
    (out,) = kernel(inputs=[rings.view(mx.uint16), rows.astype(rings.dtype).view(mx.uint16),
                            mx.array([first, M], dtype=mx.int32)],  # first grows with the sequence: not cached
                    template=[("S", S), ("W", W), ("D", D)],
                    grid=(-(-total // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
                    output_shapes=[rings.shape], output_dtypes=[mx.uint16])
    return out.view(rings.dtype)


# -------------------------------------------------------------------- hc_split

@mx.compile
def hc_split_reference(mixes: mx.array, scale: mx.array, base: mx.array, hc: int, iters: int,
                       eps: float) -> tuple[mx.array, mx.array, mx.array]:
    """Pure-MLX spec (the reference's hc_split_sinkhorn, fp32): mixes [S, (2 + hc) * hc] ->
    pre [S, hc] = sigmoid + eps, post [S, hc] = 2 sigmoid, comb [S, hc, hc] = softmax over
    each row + eps, then `iters` alternations of column and row normalisation (column
    first, each sum + eps), ending on a column pass."""
    pre = mx.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * mx.sigmoid(mixes[:, hc: 2 * hc] * scale[1] + base[hc: 2 * hc])
    comb = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(-1, hc, hc)
    comb = mx.exp(comb - comb.max(axis=-1, keepdims=True))
    comb = comb / comb.sum(axis=-1, keepdims=True) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return pre, post, comb


def hc_split(mixes: mx.array, scale: mx.array, base: mx.array, hc: int, iters: int, eps: float,
             impl: str | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """One launch for what the spec does in about 4 * iters operations (see the reference)."""
    S, M = mixes.shape
    if M != (2 + hc) * hc or iters < 1:
        raise ValueError(f"hc_split: mixes {mixes.shape} do not hold (2 + {hc}) * {hc} values per row")
    impl = impl or backend()
    if impl == "mlx":
        return hc_split_reference(mixes, scale, base, hc, iters, eps)
    kernel = _compiled(HC_SPLIT, impl)
    threads = min(S, 64)
    return tuple(kernel(inputs=[mixes.astype(mx.float32), scale, base, _float32s(eps),
                                _int32s(S)],
                        template=[("HC", hc), ("ITERS", iters)],
                        grid=(-(-S // threads) * threads, 1, 1), threadgroup=(threads, 1, 1),
                        output_shapes=[(S, hc), (S, hc), (S, hc, hc)],
                        output_dtypes=[mx.float32] * 3))


# ------------------------------------------------------------------- act_quant

def act_quant_fp8(x: mx.array, impl: str, dtype: mx.Dtype | None = None) -> mx.array:
    """The kernel for quant.fp8_fake_quant (its spec) with blocks of 32: x of any shape whose
    last axis is a multiple of 32, bfloat16 or float32; the same shape back, rounded to x's
    dtype and stored as `dtype` (default x's; float32 saves a cast before an FP8 GEMM)."""
    floats = (mx.bfloat16, mx.float32)
    dtype = dtype or x.dtype
    if x.shape[-1] % 32 or x.dtype not in floats or dtype not in floats:
        raise ValueError(f"act_quant_fp8 takes bfloat16/float32 with a last axis multiple of 32, got "
                         f"{x.dtype} {x.shape} -> {dtype}")
    kernel = _compiled(ACT_QUANT, impl)
    (y,) = kernel(inputs=[x, _int32s(x.size)], template=[("T", x.dtype), ("O", dtype)],
                  grid=(-(-x.size // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
                  output_shapes=[x.shape], output_dtypes=[dtype])
    return y


# ------------------------------------------------------- decode-step kernels

# The router, hc_input and sparse_attention kernels run for the forwards of a decode or
# verify step, up to this many rows (the router's scores kernel keeps one register per row);
# prefill's many rows take their specs.
DECODE_MAX_ROWS = 16


# -------------------------------------------------------------------- moe_gate

MOE_GATE_MAX_EXPERTS = 3072  # the top-k kernel keeps a float per expert in threadgroup memory (Metal: 32 KB)


def moe_gate_reference(x: mx.array, w: mx.array, bias: mx.array, k: int, temp: float, route_scale: float,
                       normalize: bool) -> tuple[mx.array, mx.array]:
    """Pure-MLX spec of the sqrt-softplus router (reference Gate): x [N, dim], w [E, dim] fp32,
    bias [E] -> (weights [N, k] fp32, expert ids [N, k] in ascending order). The bias picks
    the experts, the unbiased scores weight them."""
    logits = (x.astype(mx.float32) @ w.T) / temp
    scores = mx.sqrt(mx.where(logits > 20, logits, mx.log1p(mx.exp(mx.minimum(logits, 20)))))
    ids = mx.argpartition(-(scores + bias), kth=k - 1, axis=-1)[:, :k]
    ids = mx.sort(ids, axis=-1)  # the reference adds expert outputs in id order
    weights = mx.take_along_axis(scores, ids, axis=-1)
    if normalize and k > 1:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * route_scale, ids


def moe_gate(x: mx.array, w: mx.array, bias: mx.array, k: int, temp: float, route_scale: float,
             normalize: bool, impl: str | None = None) -> tuple[mx.array, mx.array]:
    """The router in two launches on a GPU for up to DECODE_MAX_ROWS rows: the scores (a
    threadgroup per expert, its weights read once for all rows), then each row's top-k (a
    simdgroup per row); the spec otherwise. The fp32 dot products are summed in another
    order than the spec's matmul, so a near-tie between two experts may fall the other way;
    each row is computed alone, the same bits in any forward (scripts/check_kernels.py
    compares the two)."""
    impl = impl or backend()
    N, D = x.shape
    E = w.shape[0]
    if (impl == "mlx" or N > DECODE_MAX_ROWS or E > MOE_GATE_MAX_EXPERTS
            or x.dtype not in (mx.bfloat16, mx.float32)):
        return moe_gate_reference(x, w, bias, k, temp, route_scale, normalize)
    (scores,) = _compiled(MOE_GATE_SCORES, impl)(
        inputs=[x, w.astype(mx.float32), _float32s(temp), _int32s(N, E, D)],
        template=[("T", x.dtype), ("RB", gate_row_bound(N)), ("D", D)], grid=(E * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(N, E)], output_dtypes=[mx.float32])
    weights, ids = _compiled(MOE_GATE_TOPK, impl)(
        inputs=[scores, bias.astype(mx.float32), _float32s(route_scale),
                _int32s(N)],
        template=[("E", E), ("K", k), ("NORMALIZE", int(normalize))], grid=(N * 32, 1, 1), threadgroup=(32, 1, 1),
        output_shapes=[(N, k), (N, k)], output_dtypes=[mx.float32, mx.uint32])
    return weights, ids


def gate_row_bound(rows: int) -> int:
    """moe_gate_scores' RB (each thread keeps a sum per row for RB rows): head_row_bound's 1, 8
    or 16, so that a decode step's one row is summed alone, not as the first of 8 (the faster
    step: docs/results.md, decode-step A/B). A row's bits do not depend on it."""
    return head_row_bound(rows)


def computed_rows(real_rows: int | None, rows: int) -> int:
    """How many of a forward's rows a kernel that can skip padding computes: the real ones
    (a padded forward's, Runner.padded), or all where real_rows is None."""
    return rows if real_rows is None else min(real_rows, rows)


def padding_zeroed(y: mx.array, real_rows: int | None) -> mx.array:
    """y [rows, ...] as such a kernel gives it: the rows from real_rows on zeros (the spec's
    side of computed_rows)."""
    if real_rows is None:
        return y
    keep = (mx.arange(y.shape[0]) < real_rows).reshape(-1, *([1] * (y.ndim - 1)))
    return mx.where(keep, y, mx.zeros_like(y))


# -------------------------------------------------------------------- hc_input

HC_MIX_CHUNKS = 16  # hc_mix's threadgroups per row (a row holds hc * dim values, a multiple of 32)
HC_INPUT_MAX_DIM = 8192  # hc_input: 32 values and 32 weights a thread


def hc_input_fits(h: mx.array, impl: str | None = None) -> bool:
    """Whether hc_input runs for this stream [S, hc, dim]: a GPU, at most DECODE_MAX_ROWS
    rows, a bfloat16 stream, dim a multiple of 32 (whole FP8 blocks) and at most
    HC_INPUT_MAX_DIM (each of the 256 threads keeps its share of the row's collapsed values
    and norm weights in registers), with (2 + hc) * hc < 32 (a lane for each mix, and one for
    the sum of squares)."""
    impl = impl or backend()
    return (impl != "mlx" and h.ndim == 3 and h.shape[0] <= DECODE_MAX_ROWS and h.dtype == mx.bfloat16
            and h.shape[2] % 32 == 0 and h.shape[2] <= HC_INPUT_MAX_DIM and (2 + h.shape[1]) * h.shape[1] < 32)


def hc_input(h: mx.array, pre_in: mx.array, fn: mx.array, scale: mx.array, base: mx.array, norm_w: mx.array,
             iters: int, hc_norm_eps: float, eps: float, norm_eps: float, quantize_to: mx.Dtype,
             impl: str | None = None) -> tuple[mx.array, ...]:
    """A sub-layer's input from the stream in two launches: the collapse by pre_in,
    RMS-normed by norm_w -> x [S, dim] bf16, x FP8 fake-quantised as quantize_to (what
    quant.fp8_input makes of x, for the sub-layer's FP8 GEMMs), and this sub-layer's mixes
    pre [S, hc], post [S, hc], comb [S, hc, hc]. The first launch (hc_mix) sums the mix
    projection in HC_MIX_CHUNKS chunks of each row, a threadgroup each, so that the 2 MB of
    fn are read by many threadgroups at once; the second (hc_input, a threadgroup per row)
    does the rest. Its spec is hyper.HyperConnection.sublayer_input's composition of hc_pre,
    rms_norm, fp8_input, the mix projection and hc_split (scripts/check_kernels.py compares
    them); only where hc_input_fits."""
    impl = _hc_input_impl(h, impl)
    S, hc, dim = h.shape
    (parts,) = _compiled(HC_MIX, impl)(
        inputs=[h, fn.astype(mx.float32), _int32s(S)], template=[("D", dim), ("HC", hc), ("CH", HC_MIX_CHUNKS)],
        grid=(S * HC_MIX_CHUNKS * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(S, HC_MIX_CHUNKS, (2 + hc) * hc + 1)], output_dtypes=[mx.float32])
    return hc_input_from_parts(h, parts, pre_in, scale, base, norm_w, iters, hc_norm_eps, eps, norm_eps, quantize_to,
                               impl)


def hc_post_input(y: mx.array, residual: mx.array, post: mx.array, comb: mx.array, pre_in: mx.array,
                  fn: mx.array, scale: mx.array, base: mx.array, norm_w: mx.array, iters: int, hc_norm_eps: float,
                  eps: float, norm_eps: float, quantize_to: mx.Dtype,
                  impl: str | None = None) -> tuple[mx.array, ...]:
    """hc_input of the stream h = hyper.hc_post(y, residual, post, comb) (the previous
    sub-layer's output y [S, dim] expanded by its mixes post [S, hc], comb [S, hc, hc] onto the
    stream residual [S, hc, dim] it ran on), in the same two launches: the first (hc_post_mix)
    computes h as it projects it and writes it out. -> (h, x, xq, pre, post, comb). Its spec is
    hyper.hc_post, then hc_input's; only where hc_input_fits the residual."""
    impl = _hc_input_impl(residual, impl)
    S, hc, dim = residual.shape
    f32 = mx.float32
    parts, h = _compiled(HC_POST_MIX, impl)(
        inputs=[y.astype(mx.bfloat16), residual, post.astype(f32), comb.astype(f32), fn.astype(f32), _int32s(S)],
        template=[("D", dim), ("HC", hc), ("CH", HC_MIX_CHUNKS)],
        grid=(S * HC_MIX_CHUNKS * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(S, HC_MIX_CHUNKS, (2 + hc) * hc + 1), (S, hc, dim)], output_dtypes=[f32, mx.bfloat16])
    return (h, *hc_input_from_parts(h, parts, pre_in, scale, base, norm_w, iters, hc_norm_eps, eps, norm_eps,
                                    quantize_to, impl))


def _hc_input_impl(h: mx.array, impl: str | None) -> str:
    impl = impl or backend()
    if not hc_input_fits(h, impl):
        raise ValueError(f"hc_input takes a bfloat16 stream [<= {DECODE_MAX_ROWS}, hc, dim] on a GPU, "
                         f"got {h.dtype} {h.shape} on {impl}")
    return impl


def hc_input_from_parts(h: mx.array, parts: mx.array, pre_in: mx.array, scale: mx.array, base: mx.array,
                        norm_w: mx.array, iters: int, hc_norm_eps: float, eps: float, norm_eps: float,
                        quantize_to: mx.Dtype, impl: str | None = None) -> tuple[mx.array, ...]:
    """hc_input's second launch, after hc_mix, hc_post_mix or fp8_into_stream made the parts of
    the stream h [S, hc, dim]: parts [S, CH, (2 + hc) * hc + 1] float32, each chunk's share of
    h's mix projection and of its sum of squares, which it adds up (each of its 8 simdgroups
    every eighth chunk in order, then the 8 sums in order). -> (x, xq, pre, post, comb) as
    hc_input's."""
    impl = _hc_input_impl(h, impl)
    S, hc, dim = h.shape
    if parts.shape[0] != S or parts.shape[2] != (2 + hc) * hc + 1:
        raise ValueError(f"hc_input's parts are [{S}, chunks, {(2 + hc) * hc + 1}] for a stream {h.shape}, "
                         f"got {parts.shape}")
    f32 = mx.float32  # the bodies read these as float32 (a build is keyed by its template values only)
    return tuple(_compiled(HC_INPUT, impl)(
        inputs=[h, pre_in.astype(f32), parts, scale.astype(f32), base.astype(f32), norm_w.astype(f32),
                _float32s(hc_norm_eps, eps, norm_eps), _int32s(S)],
        template=[("D", dim), ("HC", hc), ("ITERS", iters), ("O", quantize_to), ("CH", parts.shape[1])],
        grid=(S * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(S, dim), (S, dim), (S, hc), (S, hc), (S, hc, hc)],
        output_dtypes=[mx.bfloat16, quantize_to, f32, f32, f32]))


# ------------------------------------------------------------ sparse_attention

ATTENTION_HEADS_PER_GROUP = 2  # heads of one row per threadgroup: each key row is read once for them
# simdgroups a threadgroup: more shorten each one's chain of key reads in the scores and change
# no bits (the softmax and the weighted sum run on the first 8 whatever this is). CUDA ran 16
# faster than 8; Metal keeps 8, not yet timed (a pipeline's thread limit there depends on its
# registers)
ATTENTION_WARPS = {"cuda": 16, "metal": 8}
# (heads, simdgroups) a threadgroup where one row is computed (a decode step), where the backend has
# its own: on CUDA one head and 32 warps (faster than two heads and 16 warps; two heads at 32
# warps do not launch). Neither count changes a bit: each head's
# scores, softmax and weighted sum run alike whatever shares its threadgroup.
ATTENTION_ONE_ROW = {"cuda": (1, 32)}
ATTENTION_THREADGROUP_BYTES = 32 * 1024  # Apple GPUs' threadgroup memory


def attention_layout(impl: str, rows: int) -> tuple[int, int]:
    """(heads, simdgroups) of each threadgroup of the attention kernel on impl where it
    computes `rows` rows (a padded forward's real ones)."""
    if rows == 1 and impl in ATTENTION_ONE_ROW:
        return ATTENTION_ONE_ROW[impl]
    return ATTENTION_HEADS_PER_GROUP, ATTENTION_WARPS[impl]


def attention_threadgroup_bytes(heads: int, dim: int, keys: int) -> int:
    """The kernel's threadgroup memory for a group of `heads` heads of width dim over `keys`
    keys: the queries, the scores, the key rows, the subsets' sums (2048 floats a head: 256 /
    (dim / 8) subsets of dim features) and a few more."""
    return 4 * (heads * dim + (heads + 1) * keys + 2048 * heads + 8 + heads)


def attention_fits(q_shape: tuple[int, ...], q_dtype: mx.Dtype, n_window: int, n_picked: int,
                   impl: str | None = None) -> bool:
    """Whether sparse_attention_rows runs for queries of this shape and dtype: a GPU, at most
    DECODE_MAX_ROWS rows of bfloat16 queries [S, H, D], heads a multiple of the group, D / 8
    dividing 256 (a thread's 16-byte chunks), and the threadgroup's memory within 32 KB.
    Shapes only, so that a caller can decide before it makes the queries (the kernel takes
    them unrotated)."""
    impl = impl or backend()
    if impl == "mlx" or len(q_shape) != 3 or q_dtype != mx.bfloat16 or q_shape[0] > DECODE_MAX_ROWS:
        return False
    G = max(attention_layout(impl, rows)[0] for rows in (1, q_shape[0]))  # (any real rows may be computed)
    D = q_shape[2]
    return (q_shape[1] % G == 0 and D % 8 == 0 and 256 % (D // 8) == 0
            and attention_threadgroup_bytes(G, D, n_window + n_picked) <= ATTENTION_THREADGROUP_BYTES)


def sparse_attention_rows(q: mx.array, ring: mx.array, index: mx.array, window_mask: mx.array,
                          kv: mx.array | None, ids: mx.array | None, picked_mask: mx.array | None,
                          sink: mx.array, scale: float, rope: tuple[mx.array, ...], rope_dims: int,
                          real_rows: int | None = None, impl: str | None = None) -> mx.array:
    """attention.Attention between its query and output projections, for rows that each gather
    their own window, in one launch, without gathering the keys first: q rotated by
    Rope.apply, attention.sparse_attention, and its output rotated back (Rope.apply inverse);
    that composition is the spec (scripts/check_kernels.py). q [S, H, D] bf16, not rotated
    ([S, H * D] reads as [S, H, D], H from sink); ring [R, D] and index [S, W] (each row's
    window slots), window_mask [S, W]; kv [T, D], ids [S, K], picked_mask [S, K], or None
    for none; rope: Rope.tables(positions, D) of the
    S rows, whose last rope_dims features rotate (a model's constant: one build per value);
    real_rows: only the first real_rows rows are computed (default all), the rest, a padded
    forward's padding (Runner.padded), come out zeros. -> [S, H, D] bf16. Only where
    attention_fits."""
    impl = impl or backend()
    S, H = q.shape[0], sink.shape[0]
    D = q.shape[-1] if q.ndim == 3 else q.shape[1] // H
    W = index.shape[1]
    K = 0 if ids is None else ids.shape[1]
    if q.size != S * H * D or not attention_fits((S, H, D), q.dtype, W, K, impl):
        raise ValueError(f"sparse_attention_rows takes bfloat16 queries [<= {DECODE_MAX_ROWS}, H, D] on a GPU "
                         f"within its threadgroup memory, got {q.dtype} {q.shape} with {W} + {K} keys on {impl}")
    cos, sin = rope[:2]
    if cos.shape != (S, D // 2, 2) or sin.shape != cos.shape or rope_dims % 2 or not 0 < rope_dims <= D:
        raise ValueError(f"sparse_attention_rows takes Rope.tables of its {S} rows at width {D} and an even "
                         f"rope_dims <= {D}, got {cos.shape} and {rope_dims}")
    if K == 0:  # placeholders the kernel does not read
        kv, ids, picked_mask = _constant(mx.bfloat16, 0.0), _constant(mx.uint32, 0), _constant(mx.bool_, False)
    kernel = _compiled(SPARSE_ATTENTION, impl)
    rows = computed_rows(real_rows, S)
    G, warps = attention_layout(impl, rows)
    (out,) = kernel(inputs=[q, ring.astype(mx.bfloat16), index.astype(mx.int32), window_mask.astype(mx.bool_),
                            kv.astype(mx.bfloat16), ids.astype(mx.uint32), picked_mask.astype(mx.bool_),
                            sink.astype(mx.float32), cos.astype(mx.float32), sin.astype(mx.float32),
                            _float32s(scale), _int32s(rows)],
                    template=[("D", D), ("H", H), ("G", G), ("W", W), ("K", K), ("RD", rope_dims),
                              ("WARPS", warps)],
                    grid=(S * (H // G) * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1),
                    output_shapes=[(S, H, D)], output_dtypes=[mx.bfloat16])
    return out


# --------------------------------------------------------------------- rms_norm

@mx.compile
def rms_norm_reference(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """Pure-MLX spec: fp32 RMSNorm scaled by `weight`, returned in x's dtype (reference
    RMSNorm): x * rsqrt(mean(x^2) + eps) * weight in fp32, over the last axis."""
    return mx.fast.rms_norm(x.astype(mx.float32), weight.astype(mx.float32), eps).astype(x.dtype)


def rms_norm_fits(x: mx.array, impl: str | None = None, quantized: bool = False, rotated: bool = False) -> bool:
    """Whether the RMSNorm kernel runs for x: a GPU, bfloat16 or float32, and for the
    quantised or rotated forms a last axis of whole FP8 blocks (32)."""
    return x.size > 0 and _norm_rows_fit(x.dtype, x.shape[-1], impl, quantized or rotated)


def _norm_rows_fit(dtype: mx.Dtype, width: int, impl: str | None, whole_blocks: bool) -> bool:
    """rms_norm_fits' terms for rows of `width` values: a GPU, bfloat16 or float32, and where
    whole_blocks (the quantised or rotated forms) whole FP8 blocks (32)."""
    return (impl or backend()) != "mlx" and dtype in (mx.bfloat16, mx.float32) and not (whole_blocks and width % 32)


def rms_norm(x: mx.array, weight: mx.array, eps: float, impl: str | None = None,
             quantize_to: mx.Dtype | None = None,
             rope: tuple[mx.array, mx.array, int] | None = None) -> mx.array:
    """RMSNorm over the last axis: on a GPU one launch (a threadgroup per row) for what the
    spec does in three operations (the casts around MLX's fp32 RMSNorm); the spec elsewhere.
    rope: (cos, sin, dims), the result's last dims features then rotated as layers.rotate does
    with layers.Rope.tables' cos and sin [rows, D] (GPU only). quantize_to: the result also FP8
    fake-quantised per 32 values and stored as this dtype, in the same launch (what
    quant.fp8_input does after the spec; GPU only). Both see rms_norm_fits."""
    impl = impl or backend()
    if not rms_norm_fits(x, impl, quantize_to is not None, rope is not None):
        if quantize_to is not None or rope is not None:
            raise ValueError(f"the quantised or rotated RMSNorm kernel takes bfloat16/float32 rows of whole "
                             f"32-blocks on a GPU, got {x.dtype} {x.shape} on {impl}")
        return rms_norm_reference(x, weight, eps)
    D = x.shape[-1]
    rows = x.size // D
    out = quantize_to or x.dtype
    cos, sin, dims = rope if rope is not None else (_float32s(0.0), _float32s(0.0), 0)  # placeholders: unread
    kernel = _compiled(RMS_NORM, impl)
    (y,) = kernel(inputs=[x, weight.astype(mx.float32), _float32s(eps), _int32s(rows, D), cos, sin],
                  template=[("T", x.dtype), ("O", out), ("QUANT", int(quantize_to is not None)), ("ROPE", dims)],
                  grid=(rows * 256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape], output_dtypes=[out])
    return y


def rms_norm_pair_fits(x: mx.array, x2: mx.array, impl: str | None = None) -> bool:
    """Whether rms_norm_pair runs for x [S, D] and x2 [S, D2]: the quantised RMSNorm kernel fits
    each (x2's rotated), both 2-D of one dtype and row count."""
    return (x.ndim == x2.ndim == 2 and x.shape[0] == x2.shape[0] and x.dtype == x2.dtype
            and rms_norm_fits(x, impl, quantized=True) and rms_norm_fits(x2, impl, quantized=True, rotated=True))


def rms_norm_pair(x: mx.array, weight: mx.array, x2: mx.array, weight2: mx.array, eps: float,
                  quantize_to: mx.Dtype, quantize_to2: mx.Dtype, rope2: tuple[mx.array, mx.array, int],
                  impl: str | None = None) -> tuple[mx.array, mx.array]:
    """Two quantised RMSNorms of one eps in one launch, the second rotated: (rms_norm(x, weight,
    eps, quantize_to=quantize_to), rms_norm(x2, weight2, eps, quantize_to=quantize_to2,
    rope=rope2)), each row the same bits (attention's q_norm and kv_norm: a decode or verify
    step's launch fewer). Only where rms_norm_pair_fits."""
    impl = impl or backend()
    if not rms_norm_pair_fits(x, x2, impl):
        raise ValueError(f"rms_norm_pair takes two bfloat16/float32 inputs [S, D] and [S, D2] of whole 32-blocks on a "
                         f"GPU, got {x.dtype} {x.shape} and {x2.dtype} {x2.shape} on {impl}")
    return _rms_norm_pair(x, weight, x2, 0, weight2, x.shape, x2.shape, eps, quantize_to, quantize_to2, rope2, impl)


def rms_norm_halves(both: mx.array, rows: int, split: int, weight: mx.array, weight2: mx.array, eps: float,
                    quantize_to: mx.Dtype, quantize_to2: mx.Dtype, rope2: tuple[mx.array, mx.array, int],
                    impl: str | None = None) -> tuple[mx.array, mx.array]:
    """rms_norm_pair of fp8_gemv_pair's two products as they lie in its output `both` (pair_halves'
    views, the same bits), read there: no views made, four operations fewer a layer than
    pair_halves and rms_norm_pair. Where fp8_gemv_pair ran, this fits."""
    impl = impl or backend()
    n = both.size // rows if rows > 0 else 0
    first, second = (rows, split), (rows, n - split)
    if not (both.ndim == 1 and both.size == rows * n and 0 < split < n
            and all(_norm_rows_fit(both.dtype, w, impl, True) for w in (split, n - split))):
        raise ValueError(f"rms_norm_halves takes fp8_gemv_pair's output of {rows} rows split at {split} on a GPU, "
                         f"got {both.dtype} {both.shape} on {impl}")
    return _rms_norm_pair(both, weight, both, rows * split, weight2, first, second, eps, quantize_to, quantize_to2,
                          rope2, impl)


def _rms_norm_pair(x, weight, x2, start2, weight2, shape, shape2, eps, quantize_to, quantize_to2, rope2, impl):
    """rms_norm_pair's launch: x2's rows from element start2 of x2 on."""
    (S, D), D2 = shape, shape2[1]
    cos, sin, dims = rope2
    y, y2 = _compiled(RMS_NORM_PAIR, impl)(
        inputs=[x, weight.astype(mx.float32), x2, weight2.astype(mx.float32), _float32s(eps),
                _int32s(S, D, D2, start2), cos, sin],
        template=[("T", x.dtype), ("O", quantize_to), ("O2", quantize_to2), ("QUANT", 1), ("ROPE", dims)],
        grid=(2 * S * 256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[shape, shape2],
        output_dtypes=[quantize_to, quantize_to2])
    return y, y2


# ------------------------------------------------------------------- fp4_quant

def fp4_quant_fits(x: mx.array, block: int, impl: str | None = None) -> bool:
    """Whether the FP4 kernel runs for x: a GPU, bfloat16 or float32, blocks of 16 or 32 along
    the last axis and x.size a multiple of 32 (whole SIMD groups)."""
    impl = impl or backend()
    return (impl != "mlx" and block in (16, 32) and not x.shape[-1] % block and not x.size % 32
            and x.dtype in (mx.bfloat16, mx.float32))


def fp4_quant(x: mx.array, block: int, e4m3_scale: bool, impl: str) -> mx.array:
    """The kernel for quant.fp4_fake_quant (its spec: quant.fp4_fake_quant_reference): x of any
    shape, bfloat16 or float32, x.size a multiple of 32 and the last axis of `block` (16 or 32);
    the same shape and dtype back. e4m3_scale: the scale format (E4M3 or a power of two)."""
    if not fp4_quant_fits(x, block, impl):
        raise ValueError(f"fp4_quant takes bfloat16/float32 in blocks of 16 or 32 (size a multiple of 32), "
                         f"got {x.dtype} {x.shape} in blocks of {block} on {impl}")
    (y,) = _compiled(FP4_QUANT, impl)(
        inputs=[x, _int32s(x.size)],
        template=[("T", x.dtype), ("BLOCK", block), ("SCALE_E4M3", int(e4m3_scale))],
        grid=(-(-x.size // 256) * 256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape], output_dtypes=[x.dtype])
    return y


# ---------------------------------------------------------------------- SwiGLU

@mx.compile
def swiglu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    """SiLU(gate) * up in fp32, up clamped to +-limit and gate from above (limit > 0)."""
    if limit > 0:
        up = mx.clip(up, -limit, limit)
        gate = mx.minimum(gate, limit)
    return gate / (1 + mx.exp(-gate)) * up  # torch's SiLU: x / (1 + e^-x)


class SwiGLU(NamedTuple):
    """The SwiGLU a GEMV kernel can apply to its outputs as it writes them (its SW): the
    matrix is a gate projection's rows and an up projection's, interleaved (w13: gate row p,
    then up row p; checkpoint.stack_gate_up), and the kernel writes
    swiglu_pairs of what it would have written, in one launch instead of two. weights: a
    routed expert pair's weight, for fp4_experts ([R, k] in its pairs' order; any shape
    that flattens so and broadcasts over the outputs where the spec runs)."""
    limit: float
    weights: mx.array | None = None


def swiglu_pairs(y: mx.array, act: SwiGLU) -> mx.array:
    """The spec of a GEMV kernel's SwiGLU: y [..., 2I] bf16, each gate output followed by its
    up output (w13's rows interleaved at load: checkpoint.stack_gate_up) -> bf16 [..., I] =
    swiglu(gate, up) [* weights], in fp32, rounded to bf16 once."""
    gate, up = y[..., 0::2], y[..., 1::2]  # views: the casts fuse
    h = swiglu(gate.astype(mx.float32), up.astype(mx.float32), act.limit)
    return (h if act.weights is None else h * act.weights).astype(mx.bfloat16)


def _swiglu_arguments(act: SwiGLU | None, pairs: tuple[int, int] = (0, 0)) -> tuple[int, mx.array, mx.array]:
    """A GEMV kernel's SW and its swiglu and weights inputs: SW 0 without a SwiGLU (neither
    read), 1 with [limit], 2 with [limit] and the pairs' weights (fp4_experts: one for each
    of its ids' pairs [R, k], passed as they are: the kernel reads pair (r, j)'s at r * k + j)."""
    unread = _float32s(0.0)
    if act is None:
        return 0, unread, unread
    if act.weights is None:
        return 1, _float32s(float(act.limit)), unread
    weights = act.weights
    if weights.size != math.prod(pairs) or (weights.ndim == 2 and weights.shape[1] != pairs[1]):
        raise ValueError(f"a SwiGLU's weights are one a (row, expert) pair {pairs}, got {weights.shape}")
    return 2, _float32s(float(act.limit)), weights.astype(mx.float32)


def parts_added(y: mx.array, parts: mx.array) -> mx.array:
    """The spec of fp8_gemv's parts: y [S, N] bf16 with, in each of its first R rows, the
    parts [R, P, N] bf16 added: bf16(((parts[r, 0] + parts[r, 1]) + ...) + y[r]) in fp32 in
    that order, the later rows y's as they are (a MoE's routed experts' outputs and its
    shared expert's; the rows past R, a padded forward's padding)."""
    R, S = parts.shape[0], y.shape[0]
    total = parts[:, 0].astype(mx.float32)
    for j in range(1, parts.shape[1]):
        total = total + parts[:, j].astype(mx.float32)
    if R == S:
        return (total + y.astype(mx.float32)).astype(mx.bfloat16)
    if R == 1:  # a decode step: one select over the padding (a concatenate would be two copies)
        keep = _int32s(*range(S))[:, None] < 1
        return mx.where(keep, (total + y.astype(mx.float32)).astype(mx.bfloat16), y)
    real, padding = mx.split(y, [R])
    return mx.concatenate([(total + real.astype(mx.float32)).astype(mx.bfloat16), padding])


# -------------------------------------------------------------------- fp8_gemv

def fp8_gemv_reference(x: mx.array, w: mx.array, scales: mx.array, quantize_input: bool = False,
                       real_rows: int | None = None, swiglu: SwiGLU | None = None,
                       parts: mx.array | None = None, groups: int = 0) -> mx.array:
    """Pure-MLX spec: x [S, G, K] through G `mxfp8` matrices w [G, N, K/4] (scales [G, N, K/32]),
    group g of every row through matrix g -> bf16 [S, G, N], accumulated in float32. (A
    gather_qmm: MLX 0.32.4's CUDA quantized_matmul does not broadcast stacked weights over
    rows: other values from the second row on.) quantize_input: x FP8
    fake-quantised first (quant.fp8_fake_quant). The dense form, x [..., K] through one matrix
    w [N, K/4] -> [..., N], is that of one group. real_rows: rows from there on (a padded
    forward's padding) are zeros. swiglu: w's rows a gate and an up projection, the output
    their swiglu_pairs [..., N / 2]. parts: [R, P, N] added to the first R rows (parts_added).
    groups G: the stacked form, x [S, ...] of G * K a row and w [G * N, K/4] -> [S, G * N]."""
    if groups:
        S = x.shape[0]
        y = fp8_gemv_reference(x.reshape(S, groups, -1), w.reshape(groups, -1, w.shape[-1]),
                               scales.reshape(groups, -1, scales.shape[-1]), quantize_input, real_rows)
        return y.reshape(S, -1)
    if w.ndim == 2:
        y = fp8_gemv_reference(x.reshape(-1, 1, x.shape[-1]), w[None], scales[None], quantize_input, real_rows)
        y = y.reshape(*x.shape[:-1], w.shape[0])
    else:
        y = _gathered(_quantized_input(x, quantize_input), w, scales, mx.arange(w.shape[0]), "mxfp8")
        y = padding_zeroed(y.astype(mx.bfloat16), real_rows)
    y = y if swiglu is None else swiglu_pairs(y, swiglu)
    return y if parts is None else parts_added(y, parts)


def _quantized_input(x: mx.array, quantize: bool) -> mx.array:
    """x, or x through the FP8 fake-quant spec (the GEMV kernels' QX), in x's dtype."""
    return fp8_fake_quant_reference(x) if quantize else x


def _gathered(x: mx.array, w: mx.array, scales: mx.array, ids: mx.array, mode: str) -> mx.array:
    """MLX's gather_qmm of x [R, X, K] (X = 1 or ids' second axis) through the quantised stack
    w at ids [R, X'] (or [X']), fed float32 -> float32 [R, X', N]: the two GEMV kernels' specs."""
    return mx.gather_qmm(x[:, :, None, :].astype(mx.float32), w, scales, rhs_indices=ids, transpose=True,
                         mode=mode)[:, :, 0, :]


def fp8_gemv_fits(x: mx.array, w: mx.array, impl: str | None = None, groups: int = 0) -> bool:
    """Whether fp8_gemv runs for x [S, G, K] and w [G, N, K/4], or x [..., K] and one matrix
    w [N, K/4], or (groups G) x [S, ...] of G * K values a row and G matrices stacked in w
    [G * N, K/4]: a GPU, at most DECODE_MAX_ROWS rows (a decode or verify step's forward;
    prefill keeps MLX's GEMMs), N a multiple of 32 and K of 256 (every FP8 GEMM of the
    release)."""
    if groups:
        K = 4 * w.shape[-1]
        return (x.ndim >= 2 and w.ndim == 2 and w.shape[0] % groups == 0 and x.size == x.shape[0] * groups * K
                and _gemv_fits(x.shape[0], w.shape[0] // groups, K, impl))
    if w.ndim == 2:
        return (x.ndim >= 1 and x.size > 0 and x.shape[-1] == 4 * w.shape[1]
                and _gemv_fits(x.size // x.shape[-1], w.shape[0], x.shape[-1], impl))
    return (x.ndim == 3 and w.ndim == 3 and x.shape[1] == w.shape[0] and x.shape[2] == 4 * w.shape[2]
            and _gemv_fits(x.shape[0], w.shape[1], x.shape[2], impl))


def _gemv_fits(rows: int, n: int, k: int, impl: str | None) -> bool:
    """The two GEMV kernels' common terms: a GPU, at most DECODE_MAX_ROWS rows, n outputs a
    multiple of 32 and k inputs of 256."""
    return (impl or backend()) != "mlx" and rows <= DECODE_MAX_ROWS and n % 32 == 0 and k % 256 == 0


def gemv_layout(rows: int) -> tuple[int, int]:
    """(RB, T) of fp8_gemv for `rows` computed rows. RB, the
    bound on rows, is the least power of two holding them, T the outputs per thread group: 4
    at one row (each x value read serves T weight rows), 2 above. A thread holds T * RB sums
    in registers, and the fewer registers a thread holds the more threadgroups share a core
    (RB 8 with T 4 would halve them on CUDA). It does not change a row's bits: its sums run in
    the same order whatever the bound or the grouping."""
    rb = 1
    while rb < rows:
        rb *= 2
    return rb, (4 if rb == 1 else 2)


GEMV_FILL = 1 << 18  # outputs x threads per output to fill: 256 threadgroups at T = 4, 512 at T = 2


def gemv_threads_per_output(k: int, outputs: int) -> int:
    """fp8_gemv's C: how many threads split the k inputs of an output, 32 (a simdgroup) to 256
    (a threadgroup), the fewest that leave each thread at most 10 steps of 16 inputs and give
    a matrix of `outputs` outputs at least 256 threadgroups. A forward is a chain of GEMMs,
    each waiting for the last, so a GEMM's time is its latency: more threads per output put
    more bytes in flight at once, and a matrix of few outputs (wq_a's 1280, wkv's 512) would
    otherwise keep most of a GPU's cores idle. Depends on the matrix's shape only, so each
    output's order of additions is the same in every forward."""
    c = 32
    while c < 256 and (160 * c < k or outputs * c < GEMV_FILL):
        c *= 2
    return c


def fp8_gemv(x: mx.array, w: mx.array, scales: mx.array, impl: str | None = None,
             init_value: float | None = None, quantize_input: bool = False,
             real_rows: int | None = None, threads: int | None = None, swiglu: SwiGLU | None = None,
             parts: mx.array | None = None, groups: int = 0, after: mx.array | None = None) -> mx.array:
    """The FP8 GEMMs of a decode or verify step in one launch each: x [S, G, K] (FP8
    fake-quantised or bf16 values, exact in bf16) through G `mxfp8` matrices w [G, N, K/4] ->
    bf16 [S, G, N] (attention's wo_a: its groups), or x [..., K] through one matrix w [N, K/4]
    -> bf16 [..., N] (a dense GEMM, with no reshapes around it). groups G: w [G * N, K/4] holds
    the G matrices stacked and x [S, ...] G * K values a row (attention's [S, heads, head_dim]
    as it is) -> bf16 [S, G * N]: the same launch as with x [S, G, K] and w [G, N, K/4], whose
    bytes these are, without the views that would reshape them. Each weight byte is
    read once for all rows; the spec is fp8_gemv_reference (MLX's gather_qmm), equal up to the
    order of the float32 sums (scripts/check_kernels.py); only where fp8_gemv_fits.
    init_value poisons the output before the launch (for checks). quantize_input: x is a bf16
    activation the kernel FP8 fake-quantises as it reads it: the bits of quant.fp8_input
    followed by this kernel, in one launch. real_rows: only the first real_rows rows are
    computed (default all); the rest, a padded forward's padding (Runner.padded), come
    out zeros, their weight reads and sums spared. threads: the threads per output (C), for
    `bench.py gemms --threads` to compare layouts; a forward keeps the default,
    gemv_threads_per_output(K, N * G), so that a sum's order depends on the matrix's shape alone.
    swiglu: w is a SwiGLU's gate and up projections stacked (the shared expert's w13); the
    kernel writes their swiglu_pairs [..., N / 2] instead (no weights here). parts: [R, P, N]
    bf16, R the computed rows, added to the output as it is written (parts_added: a MoE's
    routed experts' outputs and the shared expert's sum, of a dense x [S, K]; P <= 16).
    after: an array the launch on the matrix unit (fp8_mma) takes as an input it never reads, so
    that it waits for it: MLX's CUDA graphs run a launch as soon as the arrays it takes are
    written, beside any other that is ready, and `after` places this one (moe.MoE: the
    shared expert's w13 beside the routed experts, not beside the router)."""
    impl = impl or backend()
    if not fp8_gemv_fits(x, w, impl, groups):
        raise ValueError(f"fp8_gemv takes x [<= {DECODE_MAX_ROWS}, G, K] and w [G, N, K/4], or x [..., K] of at most "
                         f"{DECODE_MAX_ROWS} rows and w [N, K/4], or x [S, ...] of G * K a row and w [G * N, K/4] "
                         f"(groups G), with N a multiple of 32 and K of 256 on a GPU, got {x.shape} and {w.shape} "
                         f"({groups} groups) on {impl}")
    _bf16_to_quantize(x, quantize_input)
    if swiglu is not None and swiglu.weights is not None:
        raise ValueError("fp8_gemv's SwiGLU takes no weights (fp4_experts' pairs have them)")
    if groups:
        K, G = 4 * w.shape[1], groups
        S, N = x.shape[0], w.shape[0] // groups
    else:
        K, G = x.shape[-1], (w.shape[0] if w.ndim == 3 else 1)
        S, N = x.size // (G * K), w.shape[-2]
    rows = computed_rows(real_rows, S)
    sw, limit, _ = _swiglu_arguments(swiglu)
    if parts is not None and (w.ndim != 2 or x.ndim != 2 or swiglu is not None):
        raise ValueError(f"fp8_gemv adds parts to a dense GEMM's x [S, K] without a SwiGLU: got parts {parts.shape} "
                         f"for x {x.shape}, w {w.shape}{' with a SwiGLU' if swiglu is not None else ''}")
    added, ap = _added_parts("fp8_gemv", parts, rows, N)
    if threads is None and rows > 0 and fp8_gemv_on_matrix_unit(N, K, G):
        tr = mma_tile_rows(N, K)
        (y,) = _compiled(FP8_MMA, impl)(
            inputs=[x.astype(mx.bfloat16), w, scales, _int32s(rows, N, K, G, S), limit, added,
                    limit if after is None else after],
            template=[("NH", mma_column_groups(rows)), ("QX", int(quantize_input)), ("SW", sw), ("AP", ap),
                      ("ONE", int(rows == 1)), ("U", mma_loads_ahead(K, rows)), ("TR", tr)],
            grid=(G * (N // tr) * 256, 1, 1), threadgroup=(256, 1, 1),
            output_shapes=[(*x.shape[:-1], N // 2 if sw else N)], output_dtypes=[mx.bfloat16], init_value=init_value)
        return y
    return _gemv_launch(FP8_GEMV, impl, [x.astype(mx.bfloat16), w, scales, _int32s(rows, N, K, G, S), limit, added],
                        rows, G, N, x.shape[:-1], init_value, quantize_input,
                        threads or gemv_threads_per_output(K, N * G), sw, [("AP", ap), ("SPLIT", 0)],
                        (S, G * N) if groups else None)


def _added_parts(kernel: str, parts: mx.array | None, rows: int, n: int) -> tuple[mx.array, int]:
    """A dense FP8 GEMM kernel's parts input and its AP: parts [rows, P, n] as bf16 and P
    (1..16), added to the output as it is written (parts_added); without parts, a constant
    the kernel never reads and AP 0."""
    if parts is None:
        return _constant(mx.bfloat16, 0.0), 0
    if parts.ndim != 3 or parts.shape[0] != rows or parts.shape[2] != n or not 0 < parts.shape[1] <= 16:
        raise ValueError(f"{kernel} adds parts [computed rows, 1..16, N]: got {parts.shape} for {rows} computed rows "
                         f"and N {n}")
    return parts.astype(mx.bfloat16), parts.shape[1]


def fp8_gemv_pair_fits(x: mx.array, w: mx.array, split: int, impl: str | None = None) -> bool:
    """Whether fp8_gemv_pair runs for x [S, K] and w [N, K/4], two matrices of `split` and
    N - split outputs stacked: fp8_gemv fits x [S, K] and each matrix alone, neither runs on
    the matrix unit, and each output's threads (C) are the same in the pair as in a launch
    of its own matrix (gemv_threads_per_output), so each is summed in the same order, with
    each matrix whole thread groups of the pair's layout."""
    if x.ndim != 2 or w.ndim != 2 or not 0 < split < w.shape[0] or not fp8_gemv_fits(x, w, impl):
        return False
    N, K = w.shape[0], x.shape[-1]
    c = gemv_threads_per_output(K, N)
    tile = 256 // c * 4  # a threadgroup's outputs at T = 4 (gemv_layout's most)
    return all(_gemv_fits(x.shape[0], n, K, impl) and not fp8_gemv_on_matrix_unit(n, K)
               and gemv_threads_per_output(K, n) == c and n % tile == 0 for n in (split, N - split))


def fp8_gemv_pair(x: mx.array, w: mx.array, scales: mx.array, split: int, impl: str | None = None,
                  init_value: float | None = None, real_rows: int | None = None) -> mx.array:
    """Two dense FP8 GEMMs of one input in one launch (attention's wq_a and wkv, both fed the
    layer's quantised input): w [N, K/4] (scales [N, K/32]) the two `mxfp8` matrices stacked,
    the first `split` rows one -> both products in one bf16 array [S * N]: x [S, K] through the
    first matrix ([S, split], row by row), then through the second ([S, N - split]), each the
    bits fp8_gemv gives for its own matrix (the kernel's SPLIT writes the two apart).
    pair_halves views them as two arrays; rms_norm_halves reads them where they lie. x is fed
    as it is (no quantize_input); real_rows as fp8_gemv's. Only where fp8_gemv_pair_fits."""
    impl = impl or backend()
    if not fp8_gemv_pair_fits(x, w, split, impl):
        raise ValueError(f"fp8_gemv_pair takes x [<= {DECODE_MAX_ROWS}, K] and two stacked matrices w [N, K/4] split "
                         f"at a row that leaves each whole thread groups of fp8_gemv's layout, off the matrix unit, "
                         f"got x {x.shape}, w {w.shape}, split {split} on {impl}")
    S, K = x.shape
    N = w.shape[0]
    rows = computed_rows(real_rows, S)
    y = _gemv_launch(FP8_GEMV, impl, [x.astype(mx.bfloat16), w, scales, _int32s(rows, N, K, 1, S), _float32s(0.0),
                                      _constant(mx.bfloat16, 0.0)],
                     rows, 1, N, (S,), init_value, False, gemv_threads_per_output(K, N), 0,
                     [("AP", 0), ("SPLIT", split)], (S * N,))
    return y


def pair_halves(both: mx.array, rows: int, split: int) -> tuple[mx.array, mx.array]:
    """fp8_gemv_pair's output as its two products: row-contiguous views [rows, split] and
    [rows, N - split]."""
    n = both.size // rows
    return both[: rows * split].reshape(rows, split), both[rows * split:].reshape(rows, n - split)


def head_logits_reference(x: mx.array, w: mx.array) -> mx.array:
    """The model's fp32 logits, as DeepSeek's reference computes them: x [S, D] and the bf16
    head w [V, D] both widened to float32 (exactly), then a float32 matmul -> [S, V]. The
    widened head (twice the release's bytes) is made a slice of the vocabulary at a time, so
    no float32 copy of the whole head exists at once."""
    x32 = x.astype(mx.float32)
    step = 16384
    return mx.concatenate([x32 @ w[v: v + step].astype(mx.float32).T for v in range(0, w.shape[0], step)], axis=-1)


def head_logits_fits(x: mx.array, w: mx.array, impl: str | None = None) -> bool:
    """Whether head_logits runs: a GPU, bf16 x [S, D] of at most DECODE_MAX_ROWS rows (a
    decode or verify step, or prefill's last row) and a bf16 head w [V, D], V a multiple of 32
    and D of 256 (the release's 129280 x 5120)."""
    return ((impl or backend()) != "mlx" and x.ndim == 2 and w.ndim == 2 and x.dtype == mx.bfloat16
            and w.dtype == mx.bfloat16 and 0 < x.shape[0] <= DECODE_MAX_ROWS and x.shape[1] == w.shape[1]
            and w.shape[0] % 32 == 0 and w.shape[1] % 256 == 0)


def head_row_bound(rows: int) -> int:
    """head_logits' R (its per-lane sums are sized for R rows): 1, 8 or 16. A row's bits do
    not depend on it."""
    return 1 if rows == 1 else 8 if rows <= 8 else 16


def head_logits(x: mx.array, w: mx.array, impl: str | None = None, real_rows: int | None = None,
                init_value: float | None = None) -> mx.array:
    """The model's fp32 logits from its bf16 head in one launch, each weight byte read once for
    all rows: x [S, D] bf16, w [V, D] bf16 -> [S, V] float32; the spec is
    head_logits_reference, equal up to the order of the float32 sums (each product is exact),
    each row summed in one order at any S. Reading the head as the release stores it reads
    half the bytes of the float32 copy a float32 matmul needs. real_rows: only those rows
    computed, the rest zeros (a padded forward); init_value poisons the output first (checks)."""
    impl = impl or backend()
    if not head_logits_fits(x, w, impl):
        raise ValueError(f"head_logits takes bf16 x [<= {DECODE_MAX_ROWS}, D] and a bf16 head [V, D], V a multiple "
                         f"of 32 and D of 256, on a GPU: got {x.dtype} {x.shape} and {w.dtype} {w.shape} on {impl}")
    S, V, D = x.shape[0], w.shape[0], w.shape[1]
    rows = computed_rows(real_rows, S)
    (y,) = _compiled(HEAD_LOGITS, impl)(
        inputs=[x, w, _int32s(rows, V, D, S)], template=[("R", head_row_bound(rows))],
        grid=(V // 32 * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(S, V)], output_dtypes=[mx.float32], init_value=init_value)
    return y


# The dense FP8 GEMMs of at least this many outputs run on the matrix unit (fp8_mma, the
# layout of fp4_experts: a threadgroup per 32 outputs, 8 simdgroups splitting K, the rows the
# products' columns), where a forward's rows share each weight code's decoding; smaller ones
# (wq_a's 1280 outputs, wkv's 512) keep fp8_gemv, whose threads per output fill the GPU. By
# shape only, so each matrix sums in one order at every row count. The matrix unit wins at a
# verify forward's rows; at one row the long ones are a little slower than on fp8_gemv, which
# a decode step bound by its host side hides.
FP8_MMA_MIN_OUTPUTS = 4096
# The matrix-unit kernels (fp8_mma, fp4_experts) stage a tile's weight scales, K bytes, in a
# fixed threadgroup buffer (mma_x.cuh's mma_tile_scales, which holds the same MMA_MAX_K): K at
# most this (the release's largest is wo_b's 8192)
MMA_MAX_K = 8192


def fp8_gemv_on_matrix_unit(n: int, k: int, groups: int = 1) -> bool:
    """Whether fp8_gemv runs a GEMM of `groups` matrices of n outputs and k inputs on the
    matrix unit."""
    return groups == 1 and n >= FP8_MMA_MIN_OUTPUTS and k <= MMA_MAX_K


class StreamOnto(NamedTuple):
    """Where a sub-layer's last GEMM puts its output y [S, N] with fp8_into_stream: the
    hyper-connection stream residual [S, hc, N] bf16 the sub-layer ran on, the sub-layer's
    mixes post [S, hc] and comb [S, hc, hc], and the next sub-layer's mix projection fn
    [(2 + hc) * hc, hc * N] float32. A tuple of arrays (a compiled method takes it as one)."""
    residual: mx.array
    post: mx.array
    comb: mx.array
    fn: mx.array


def fp8_into_stream_fits(w: mx.array, residual: mx.array, impl: str | None = None) -> bool:
    """Whether fp8_into_stream runs the dense FP8 GEMM of w [N, K/4] for the stream residual
    [S, hc, N]: hc_input fits the stream (a GPU, a decode or verify step's rows), and fp8_gemv
    runs the GEMM on the matrix unit (fp8_mma)."""
    return (w.ndim == 2 and residual.ndim == 3 and residual.shape[2] == w.shape[0] and hc_input_fits(residual, impl)
            and _gemv_fits(residual.shape[0], w.shape[0], 4 * w.shape[1], impl)
            and fp8_gemv_on_matrix_unit(w.shape[0], 4 * w.shape[1]))


def fp8_into_stream(x: mx.array, w: mx.array, scales: mx.array, onto: StreamOnto, impl: str | None = None,
                    quantize_input: bool = False, real_rows: int | None = None,
                    parts: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """A sub-layer's last FP8 GEMM with its output y = fp8_gemv(x, w, scales, ..) [S, N] put into
    the hyper-connection stream in the same launch (fp8_mma_hc): -> (h, mix_parts), h [S, hc, N]
    bf16 the new stream hyper.hc_post(y, onto.residual, onto.post, onto.comb) (hc_post_mix's bits
    for the same y), mix_parts [S, N / 32, (2 + hc) * hc + 1] float32 each tile of 32 features'
    share of h's projection by onto.fn and of its sum of squares, which hc_input_from_parts
    completes into the next sub-layer's input: a launch (hc_post_mix) a sub-layer fewer, and the
    2 MB of fn read by N / 32 threadgroups instead of HC_MIX_CHUNKS. x [S, K], quantize_input,
    real_rows and parts as fp8_gemv's (a dense GEMM without a SwiGLU); every row of h, a padded
    forward's padding included (its y zeros), as hc_post_mix makes them. The spec is
    fp8_gemv_reference, hyper.hc_post and the mix projection (scripts/check_kernels.py); only
    where fp8_into_stream_fits."""
    impl = impl or backend()
    residual, post, comb, fn = onto  # (a compiled method hands a StreamOnto on as a plain tuple)
    S, hc, N = residual.shape
    if not (fp8_into_stream_fits(w, residual, impl) and x.ndim == 2 and x.shape == (S, 4 * w.shape[1])):
        raise ValueError(f"fp8_into_stream takes x [S, K], w [N, K/4] on the matrix unit and a stream [S, hc, N] that "
                         f"hc_input fits, got x {x.shape}, w {w.shape}, stream {residual.dtype} {residual.shape} "
                         f"on {impl}")
    _bf16_to_quantize(x, quantize_input)
    K = x.shape[1]
    rows = computed_rows(real_rows, S)
    added, ap = _added_parts("fp8_into_stream", parts, rows, N)
    if rows == 0:
        raise ValueError("fp8_into_stream computes at least one row")
    f32, M = mx.float32, (2 + hc) * hc
    h, mix_parts = _compiled(FP8_MMA_HC, impl)(
        inputs=[x.astype(mx.bfloat16), w, scales, _int32s(rows, N, K, 1, S), added, residual, post.astype(f32),
                comb.astype(f32), fn.astype(f32)],
        template=[("NH", mma_column_groups(rows)), ("QX", int(quantize_input)), ("AP", ap), ("ONE", int(rows == 1)),
                  ("HC", hc), ("U", mma_loads_ahead(K, rows)), ("TR", 32)],
        grid=(N // 32 * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(S, hc, N), (S, N // 32, M + 1)], output_dtypes=[mx.bfloat16, f32])
    return h, mix_parts


# The decode path lets a GEMV kernel quantise its bf16 input (quantize_input) for a forward of
# up to this many computed rows, and quantises it first (act_quant) for more. Each threadgroup
# quantises every row it reads again, so that work grows with the rows while the launch it
# saves does not: at one row the saved launches win, at a verify step's rows the repeated
# work costs more than act_quant. Either way the same bits.
QUANTIZE_IN_KERNEL_ROWS = 1
# The matrix-unit kernels (fp8_mma, fp4_experts) quantise x a 32-column block at a time as
# they stage it, for every row of their one column group: up to 8 rows they take it in, the
# act_quant launches saved outweighing the extra work.
QUANTIZE_IN_MMA_ROWS = 8


def quantizes_in_kernel(x: mx.array, rows: int, matrix_unit: bool = False) -> bool:
    """Whether a GEMV kernel that fits should quantise x itself: bf16 input (the kernels
    quantise no other) of at most QUANTIZE_IN_KERNEL_ROWS computed rows, or
    QUANTIZE_IN_MMA_ROWS for a kernel on the matrix unit (fp8_mma, fp4_experts)."""
    return x.dtype == mx.bfloat16 and rows <= (QUANTIZE_IN_MMA_ROWS if matrix_unit else QUANTIZE_IN_KERNEL_ROWS)


def _bf16_to_quantize(x: mx.array, quantize_input: bool) -> None:
    """The GEMV kernels quantise only bf16 input: a wider one would be rounded to bf16 first,
    and rounded twice it could land elsewhere than the spec's one rounding."""
    if quantize_input and x.dtype != mx.bfloat16:
        raise ValueError(f"a GEMV kernel quantises bfloat16 input only, got {x.dtype}")


def _gemv_launch(spec: KernelSpec, impl: str, inputs: list, rows: int, sets: int, n: int, lead: tuple,
                 init_value: float | None, quantize_input: bool, threads: int, sw: int, more: list,
                 shape: tuple | None = None) -> mx.array:
    """Launch fp8_gemv for `rows` computed rows (up to 16): `sets` matrices of n outputs, a
    threadgroup of 256 threads per (256 / C) * T outputs of a matrix -> bf16 [*lead, n], or
    [*lead, n / 2] with a SwiGLU (sw > 0); shape: those values in another shape (fp8_gemv_pair's
    two products, written apart, on one axis; a grouped GEMM's [S, G * N]). threads: C
    (gemv_threads_per_output, or bench's choice); (RB, T): gemv_layout(rows). more: the
    kernel's other template constants."""
    if threads not in (32, 64, 128, 256):  # a threadgroup then holds 32 to 4 outputs: N is a multiple of 32
        raise ValueError(f"a GEMV kernel takes 32, 64, 128 or 256 threads per output, got {threads}")
    rb, t = gemv_layout(rows)
    (y,) = _compiled(spec, impl)(
        inputs=inputs,
        template=[("RB", rb), ("T", t), ("C", threads), ("QX", int(quantize_input)), ("SW", sw), *more],
        grid=(sets * n // (256 // threads * t) * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[shape or (*lead, n // 2 if sw else n)], output_dtypes=[mx.bfloat16], init_value=init_value)
    return y


# ----------------------------------------------------------------- fp4_experts

def fp4_experts_reference(x: mx.array, w: mx.array, scales: mx.array, ids: mx.array,
                          quantize_input: bool = False, swiglu: SwiGLU | None = None,
                          rows: int | None = None) -> mx.array:
    """Pure-MLX spec: pair (r, j) = row r's j-th expert ids[r, j] of the `mxfp4` stack w [E, N, K/8]
    (scales [E, N, K/32]) applied to x[r, 0] (x [R, 1, K], or [R, K]) or x[r, j] (x [R, k, K])
    -> bf16 [R, k, N], accumulated in float32. quantize_input: x FP8 fake-quantised first.
    swiglu: the output's swiglu_pairs [R, k, N / 2], the pairs' weights [R, k] applied. rows:
    only the first `rows` rows of x, ids and the weights (the kernel's rows=)."""
    if rows is not None:
        x, ids = x[:rows], ids[:rows]
        if swiglu is not None and swiglu.weights is not None:
            swiglu = SwiGLU(swiglu.limit, swiglu.weights[:rows])
    x = x[:, None] if x.ndim == 2 else x
    y = _gathered(_quantized_input(x, quantize_input), w, scales, ids, "mxfp4").astype(mx.bfloat16)
    if swiglu is None:
        return y
    weights = None if swiglu.weights is None else swiglu.weights.reshape(*ids.shape, 1)
    return swiglu_pairs(y, SwiGLU(swiglu.limit, weights))


def fp4_experts_fits(x: mx.array, w: mx.array, ids: mx.array, impl: str | None = None,
                     rows: int | None = None) -> bool:
    """Whether fp4_experts runs: a GPU, x [R, 1 or k, K] (or [R, K], as [R, 1, K]) with R <=
    DECODE_MAX_ROWS, ids [R, k], w [E, N, K/8] with N a multiple of 32 and K of 256, at most
    MMA_MAX_K. rows: R,
    where x and ids hold more rows than are computed (their first R; default all)."""
    R = ids.shape[0] if rows is None else rows
    slots = x.shape[1] if x.ndim == 3 else 1
    return (x.ndim in (2, 3) and w.ndim == 3 and ids.ndim == 2 and 0 < R <= min(ids.shape[0], x.shape[0])
            and slots in (1, ids.shape[1]) and x.shape[-1] == 8 * w.shape[2] and x.shape[-1] <= MMA_MAX_K
            and _gemv_fits(R, w.shape[1], x.shape[-1], impl))


def fp4_experts(x: mx.array, w: mx.array, scales: mx.array, ids: mx.array, impl: str | None = None,
                init_value: float | None = None, quantize_input: bool = False,
                swiglu: SwiGLU | None = None, rows: int | None = None) -> mx.array:
    """The routed experts' FP4 GEMMs of a decode or verify step in one launch: x [R, 1 or k, K]
    (FP8 fake-quantised, exact in bf16; [R, K] reads as [R, 1, K]) through each row's experts
    ids [R, k] of the `mxfp4` stack w [E, N, K/8] -> bf16 [R, k, N], each expert's weights
    read once for all the rows that picked it (MLX's gather_qmm reads them once per (row,
    expert) pair). The spec is fp4_experts_reference, equal up to the order of the float32
    sums; only where fp4_experts_fits. A row's experts must be distinct (a router's top-k
    are). init_value poisons the output before the launch (for checks); quantize_input as
    fp8_gemv's. swiglu: w is the experts' gate and up projections stacked (w13); the kernel
    writes their swiglu_pairs [R, k, N / 2], times each pair's weight where swiglu has
    weights [R, k]. rows: R, where x, ids and the weights hold more rows (a padded forward's:
    only its first R, the real ones, are computed and returned). The kernel indexes its
    inputs itself, so none of them is reshaped or sliced first: no view operations."""
    impl = impl or backend()
    if not fp4_experts_fits(x, w, ids, impl, rows):
        raise ValueError(f"fp4_experts takes x [<= {DECODE_MAX_ROWS}, 1 or k, K] (or [R, K]), ids [R, k] and w "
                         f"[E, N, K/8] with N a multiple of 32 and K of 256 on a GPU, got {x.shape}, {ids.shape} and "
                         f"{w.shape} for {rows} rows on {impl}")
    _bf16_to_quantize(x, quantize_input)
    R, k = (ids.shape[0] if rows is None else rows), ids.shape[1]
    N, K = w.shape[1], x.shape[-1]
    sw, limit, weights = _swiglu_arguments(swiglu, ids.shape)
    slots = x.shape[1] if x.ndim == 3 else 1
    prepared = experts_prepare_x(R)
    if prepared:
        x, xs = mma_x_prepared(x, R * slots, quantize_input, impl)
    else:
        x, xs = x.astype(mx.bfloat16), _float32s(0.0)  # (xs unread)
    (y,) = _compiled(FP4_EXPERTS, impl)(
        inputs=[x, xs, w, scales, ids.astype(mx.uint32), _int32s(R, k, N, K, slots), limit, weights],
        template=fp4_experts_template(R, K, quantize_input, sw, prepared),
        grid=(R * k * (N // 32) * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(R, k, N // 2 if sw else N)], output_dtypes=[mx.bfloat16], init_value=init_value)
    return y


def fp4_experts_template(rows: int, k: int, quantize_input: bool, sw: int, prepared: bool) -> list[tuple[str, int]]:
    """fp4_experts' template constants for `rows` computed rows of K = k (SW as _swiglu_arguments
    gives it; prepared: x from mma_x_prep, experts_prepare_x)."""
    return [("NH", mma_column_groups(rows)), ("QX", int(quantize_input)), ("SW", sw), ("ONE", int(rows == 1)),
            ("U", experts_loads_ahead(rows, k)), ("PX", int(prepared))]


def experts_prepare_x(rows: int) -> bool:
    """Whether fp4_experts takes its x prepared by mma_x_prep (x / s and s a block, the values
    its threadgroups would compute): for more than one row. Each threadgroup (an expert's tile
    of 32 outputs: 144 of them an expert for w13) otherwise computes them again for its block
    range, which at a verify forward's rows costs more than a launch; at one row it does not.
    No bit depends on it (both twins emulated, tests/test_kernel_emulation.py;
    scripts/check_kernels.py fp4_experts: a row alone, not prepared, the same bits as the row
    among 8, prepared)."""
    return rows > 1


def mma_x_prepared(x: mx.array, n: int, quantize_input: bool, impl: str) -> tuple[mx.array, mx.array]:
    """x [.., K] bf16 (its first n rows of K) -> (x / s as fp16 bits, uint16 [n, K]; s, float32
    [n, K / 32]): mma_x_prep, the B side of the matrix-unit kernels' products a block at a
    time, x FP8 fake-quantised first where quantize_input."""
    K = x.shape[-1]
    return _compiled(MMA_X_PREP, impl)(
        inputs=[x.astype(mx.bfloat16), _int32s(n, K)], template=[("QX", int(quantize_input))],
        grid=(n * K, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(n, K), (n, K // 32)],
        output_dtypes=[mx.uint16, mx.float32])


def experts_loads_ahead(rows: int, k: int) -> int:
    """U of fp4_experts on CUDA for `rows` computed rows of K = k: the blocks whose weight loads a
    warp issues before it uses the first (the Metal twin stages its tiles otherwise and ignores
    it). No bit depends on it. 2 (the fastest at six rows), but 1 for one row of a short K
    (w2's 2304: nine blocks a warp; docs/results.md, `bench.py layouts`)."""
    return 1 if rows == 1 and k < 4096 else 2


def mma_loads_ahead(k: int, rows: int) -> int:
    """U of fp8_mma (and fp8_mma_hc) on CUDA: the 32-column blocks whose weight loads a warp
    issues before it uses the first (the Metal twin stages its tiles otherwise and ignores it).
    No bit depends on it: each block's sums are added in the same order. 6 (the fastest on long
    shapes), but 2 for one row of a short K (< 2048: wq_b's 1280, five blocks a warp), where
    fewer registers a thread let more threadgroups run at once (docs/results.md, `bench.py
    layouts`)."""
    return 2 if rows == 1 and k < 2048 else 6


def mma_tile_rows(n: int, k: int) -> int:
    """TR of fp8_mma: the weight rows (outputs) a threadgroup takes, 32 or 16, for a GEMM of n
    outputs and k inputs (fp8_mma_hc keeps 32: its mix parts are a 32-feature tile's). No bit
    depends on it: an output's sums are the same products in the same order either way. 32:
    16 doubles the threadgroups of a grid of few tiles, yet it won none of the release's shapes
    at one row (docs/results.md, `bench.py layouts`), nor one-row steps."""
    return 32


# fp4_experts runs on the matrix unit (mma.sync on CUDA, simdgroup matrices on Metal): a
# pass's pairs are a product's columns, so an expert's codes are decoded once for up to 8
# (NH 1) or 16 pairs, not again for each pair.
def mma_column_groups(rows: int) -> int:
    """NH of the matrix-unit kernels (fp4_experts, fp8_mma): their products' column groups
    of 8 (fp4_experts' pairs a pass, fp8_mma's rows): 1 up to 8 rows (an expert is picked at
    most once a row), 2 above. A row's bits do not depend on it: each column of a
    matrix-unit product is summed on its own."""
    return 1 if rows <= 8 else 2


# ------------------------------------------------------------------- rows_gate

# How many times rows_gate reads the host's flag before it gives up: on CUDA a read and a
# 256 ns sleep, so some seconds; the host releases a gate within a fraction of a millisecond of
# reading the token (Runner._forward_built_ahead), and a gate that gives up is reported.
GATE_SPINS = 1 << 24


def rows_gate_fits() -> bool:
    """Whether a forward's launches may be queued behind rows_gate, waiting on the device for
    the host's engram rows: on CUDA, where one-row steps run shorter with the same replies. The
    gate has no Metal twin: elsewhere the forward's blocks are started once the rows are
    written, as without it."""
    return backend() == "cuda"


def rows_gate(flag: mx.array, rows: mx.array) -> tuple[mx.array, mx.array]:
    """One launch on CUDA (where rows_gate_fits) that waits on the device until the host
    releases it through flag (uint32 [3], runtime.staged.StagedRows; rows_gate.cu says how),
    then copies rows (uint8 [N], the host-written buffer) -> (status uint32 [2]: 1 if it gave
    up waiting, else 0, and the release count it saw; the rows as they were at the release).
    What reads the copy runs after the release."""
    if flag.dtype != mx.uint32 or flag.shape != (3,):
        raise ValueError(f"rows_gate: the flag must be uint32 [3]; got {flag.dtype} {flag.shape}")
    if rows.dtype != mx.uint8 or rows.ndim != 1:
        raise ValueError(f"rows_gate: the rows must be uint8 [N]; got {rows.dtype} {rows.shape}")
    kernel = _compiled(ROWS_GATE, "cuda")
    status, out = kernel(inputs=[flag, rows], template=[("SPINS", GATE_SPINS), ("N", rows.size)],
                         grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(2,), rows.shape],
                         output_dtypes=[mx.uint32, mx.uint8])
    return status, out
