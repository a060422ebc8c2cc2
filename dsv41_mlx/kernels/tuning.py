"""The kernels' launch layout: the choices a kernel's text leaves to its wrapper, as one value.

A `Layout` holds them all; the wrappers read `current()`, the package's `Layout()` unless a
caller chose another for a block (`with using(layout):`, as `bench.py layouts` and `steps`
do to time candidates, and tests do to compare them). No field but gemv_fill and
mma_min_outputs changes a bit of any output; those two pick a GEMM's kernel and summation
order by its shape alone, so that every forward sums a matrix alike under one Layout.

The layout is read while a launch is built, so a compiled function traced under one Layout
keeps its choices. It is a context variable: it holds on the thread that chose it, where the
graphs are built and traced.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping


def _gemv_layout(rows: int) -> tuple[int, int]:
    """(RB, T) of fp8_gemv for `rows` computed rows. RB, the bound on rows, is the least power
    of two holding them, T the outputs per thread group: 4 at one row (each x value read
    serves T weight rows), 2 above. A thread holds T * RB sums in registers, and the fewer
    registers a thread holds the more threadgroups share a core (RB 8 with T 4 would halve
    them on CUDA). It does not change a row's bits: its sums run in the same order whatever
    the bound or the grouping."""
    rb = 1
    while rb < rows:
        rb *= 2
    return rb, (4 if rb == 1 else 2)


def _mma_tile_rows(n: int, k: int) -> int:
    """TR of fp8_mma: the weight rows (outputs) a threadgroup takes, 32 or 16, for a GEMM of n
    outputs and k inputs (fp8_mma_hc keeps 32: its mix parts are a 32-feature tile's). No bit
    depends on it: an output's sums are the same products in the same order either way. 32:
    16 doubles the threadgroups of a grid of few tiles, yet it won none of the release's shapes
    at one row (docs/results.md, `bench.py layouts`), nor one-row steps."""
    return 32


def _mma_loads_ahead(k: int, rows: int) -> int:
    """U of fp8_mma (and fp8_mma_hc) on CUDA: the 32-column blocks whose weight loads a warp
    issues before it uses the first (the Metal twin stages its tiles otherwise and ignores it).
    No bit depends on it: each block's sums are added in the same order. 6 (the fastest on long
    shapes), but 2 for one row of a short K (< 2048: wq_b's 1280, five blocks a warp), where
    fewer registers a thread let more threadgroups run at once (docs/results.md, `bench.py
    layouts`)."""
    return 2 if rows == 1 and k < 2048 else 6


def _experts_loads_ahead(rows: int, k: int) -> int:
    """U of fp4_experts on CUDA for `rows` computed rows of K = k: the blocks whose weight loads a
    warp issues before it uses the first (the Metal twin stages its tiles otherwise and ignores
    it). No bit depends on it. 2 (the fastest at six rows), but 1 for one row of a short K
    (w2's 2304: nine blocks a warp; docs/results.md, `bench.py layouts`)."""
    return 1 if rows == 1 and k < 4096 else 2


def _mma_column_groups(rows: int) -> int:
    """NH of the matrix-unit kernels (fp4_experts, fp8_mma): their products' column groups of 8
    (fp4_experts' pairs a pass, fp8_mma's rows): 1 up to 8 rows (an expert is picked at most
    once a row), 2 above. A row's bits do not depend on it: each column of a matrix-unit
    product is summed on its own."""
    return 1 if rows <= 8 else 2


def _experts_prepare_x(rows: int) -> bool:
    """Whether fp4_experts takes its x prepared by mma_x_prep (x / s and s a block, the values
    its threadgroups would compute): for more than one row. Each threadgroup (an expert's tile
    of 32 outputs: 144 of them an expert for w13) otherwise computes them again for its block
    range, which at a verify forward's rows costs more than a launch; at one row it does not.
    No bit depends on it (both twins emulated, tests/test_kernel_emulation.py;
    scripts/check_kernels.py fp4_experts: a row alone, not prepared, the same bits as the row
    among 8, prepared)."""
    return rows > 1


def _head_row_bound(rows: int) -> int:
    """head_logits' R (its per-lane sums are sized for R rows): 1, 8 or 16. A row's bits do not
    depend on it."""
    return 1 if rows == 1 else 8 if rows <= 8 else 16


def _gate_row_bound(rows: int) -> int:
    """moe_gate_scores' RB (each thread keeps a sum per row for RB rows): 1, 8 or 16, as
    head_logits' R, so that a decode step's one row is summed alone, not as the first of 8
    (the faster step: docs/results.md, decode-step A/B). A row's bits do not depend on it."""
    return _head_row_bound(rows)


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class Layout:
    """How the kernels are launched. Plain values, and rules of a launch's shape (each
    default a function above, whose docstring says why)."""

    # sparse_attention, see `attention`: heads of one row a threadgroup (each key row is read
    # once for them)
    attention_heads: int = 2
    # simdgroups a threadgroup per backend: more shorten each one's chain of key reads in the
    # scores and change no bits (the softmax and the weighted sum run on the first 8 whatever
    # this is). CUDA ran 16 faster than 8; Metal keeps 8, not yet timed (a pipeline's thread
    # limit there depends on its registers)
    attention_warps: Mapping[str, int] = field(default_factory=lambda: _frozen({"cuda": 16, "metal": 8}))
    # (heads, simdgroups) where one row is computed (a decode step), where the backend has its
    # own: on CUDA one head and 32 warps (faster than two heads and 16 warps; two heads at 32
    # warps do not launch). Each head's scores, softmax and weighted sum run alike whatever
    # shares its threadgroup.
    attention_one_row: Mapping[str, tuple[int, int]] = field(default_factory=lambda: _frozen({"cuda": (1, 32)}))
    # fp8_gemv: outputs x threads per output to fill (gemv_threads_per_output): 256 threadgroups
    # at T = 4, 512 at T = 2. It sets the threads that split an output's sum, so its order.
    gemv_fill: int = 1 << 18
    gemv_layout: Callable[[int], tuple[int, int]] = _gemv_layout  # rows -> (RB, T)
    # The dense FP8 GEMMs of at least this many outputs run on the matrix unit (fp8_mma, the
    # layout of fp4_experts: a threadgroup per 32 outputs, 8 simdgroups splitting K, the rows the
    # products' columns), where a forward's rows share each weight code's decoding; smaller ones
    # (wq_a's 1280 outputs, wkv's 512) keep fp8_gemv, whose threads per output fill the GPU. By
    # shape only, so each matrix sums in one order at every row count. The matrix unit wins at a
    # verify forward's rows; at one row the long ones are a little slower than on fp8_gemv, which
    # a decode step bound by its host side hides.
    mma_min_outputs: int = 4096
    mma_tile_rows: Callable[[int, int], int] = _mma_tile_rows  # (n, k) -> TR
    mma_loads_ahead: Callable[[int, int], int] = _mma_loads_ahead  # (k, rows) -> U
    experts_loads_ahead: Callable[[int, int], int] = _experts_loads_ahead  # (rows, k) -> U
    mma_column_groups: Callable[[int], int] = _mma_column_groups  # rows -> NH
    experts_prepare_x: Callable[[int], bool] = _experts_prepare_x  # rows -> whether mma_x_prep runs first
    # The decode path lets a GEMV kernel quantise its bf16 input (quantize_input) for a forward
    # of up to this many computed rows, and quantises it first (act_quant) for more. Each
    # threadgroup quantises every row it reads again, so that work grows with the rows while the
    # launch it saves does not: at one row the saved launches win, at a verify step's rows the
    # repeated work costs more than act_quant. Either way the same bits.
    quantize_in_kernel_rows: int = 1
    # The matrix-unit kernels (fp8_mma, fp4_experts) quantise x a 32-column block at a time as
    # they stage it, for every row of their one column group: up to 8 rows they take it in, the
    # act_quant launches saved outweighing the extra work.
    quantize_in_mma_rows: int = 8
    head_row_bound: Callable[[int], int] = _head_row_bound  # rows -> head_logits' R
    gate_row_bound: Callable[[int], int] = _gate_row_bound  # rows -> moe_gate_scores' RB

    def __post_init__(self):
        for name in ("attention_warps", "attention_one_row"):  # read-only, as the rest
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    def attention(self, impl: str, rows: int) -> tuple[int, int]:
        """(heads, simdgroups) of each threadgroup of the attention kernel on impl where it
        computes `rows` rows (a padded forward's real ones)."""
        if rows == 1 and impl in self.attention_one_row:
            return self.attention_one_row[impl]
        return self.attention_heads, self.attention_warps[impl]


_current: ContextVar[Layout] = ContextVar("dsv41_mlx_layout", default=Layout())


def current() -> Layout:
    """The layout the kernels launch with here: the innermost `using`'s, else `Layout()`."""
    return _current.get()


@contextlib.contextmanager
def using(layout: Layout):
    """Inside: the kernels launch with `layout` (on this thread; restored on the way out)."""
    token = _current.set(layout)
    try:
        yield layout
    finally:
        _current.reset(token)
