"""How a kernel reaches the device: its sources (`metal_kernels/`), which backend runs it, its
build (cached), the small constant arguments every launch shares, and the rows a decode or
verify step's kernels compute.

Tests and scripts take the GPU's dispatch on any machine through one seam, `dispatching`:
dispatch as on backend X with this kernel builder.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import mlx.core as mx

# The router, hc_input and sparse_attention kernels run for the forwards of a decode or
# verify step, up to this many rows (the router's scores kernel keeps one register per row);
# prefill's many rows take their specs.
DECODE_MAX_ROWS = 16


def kernel_dir() -> Path:
    """metal_kernels/ of a source checkout, else the copy installed beside the package."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package.parent / "metal_kernels", package / "metal_kernels"):
        if (candidate / "fp8_rows.metal").exists():
            return candidate
    raise FileNotFoundError(f"metal_kernels/ not found next to {package}")


def kernel_text(filename: str) -> str:
    return (kernel_dir() / filename).read_text()


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


# ------------------------------------------------------------------ dispatch

@dataclass(frozen=True)
class Dispatch:
    """Where the wrappers send their launches (see `dispatching`)."""

    backend: str | None = None  # what backend() answers; None: its own rule
    build: Callable | None = None  # (spec, language) -> kernel; None: compile_kernel
    device: str | None = None  # what device_backend() answers; None: this machine's
    any_shape: bool = False  # the built kernels take any shape: the GEMV kernels' shape terms are dropped


_dispatch: ContextVar[Dispatch] = ContextVar("dsv41_mlx_dispatch", default=Dispatch())


@contextlib.contextmanager
def dispatching(backend: str | None = None, build: Callable | None = None, device: str | None = None,
                any_shape: bool = False):
    """Inside: the wrappers dispatch as on `backend` ('metal', 'cuda' or 'mlx': what backend()
    answers) with kernels from build(spec, language) (default compile_kernel), on a device
    that is `device` (what device_backend() answers, and so the GEMMs' input dtype,
    quant.gemm_input_dtype; default this machine's). A stand-in kernel is called as mx.fast's
    are (inputs=, template=, grid=, threadgroup=, output_shapes=, output_dtypes=, init_value=)
    and returns the outputs. any_shape: the stand-ins take any shape, so the GEMV kernels' fits
    keep their row bound only and fp8_into_stream fits any GEMM as wide as its stream
    (scripts/count_ops.py counts a small checkpoint's step as the release's).

    How tests and scripts take the GPU's dispatch on a CPU; the package never enters it. It is
    a context variable: it holds on this thread (where graphs are built and traced), not on a
    thread started inside, and a compiled function traced inside keeps what it dispatched."""
    token = _dispatch.set(Dispatch(backend, build, device, any_shape))
    try:
        yield
    finally:
        _dispatch.reset(token)


def any_shape() -> bool:
    """Whether the kernels dispatched to take any shape (`dispatching`'s any_shape)."""
    return _dispatch.get().any_shape


def device_backend() -> str:
    """'metal', 'cuda' or 'mlx' (the CPU): what the default device runs on."""
    return _device(_dispatch.get())


def _device(dispatch: Dispatch) -> str:
    if dispatch.device is not None:
        return dispatch.device
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
    dispatch = _dispatch.get()
    if dispatch.backend is not None:
        return dispatch.backend
    return "mlx" if kernels_switched_off() else _device(dispatch)


@lru_cache(maxsize=None)
def kernels_switched_off() -> bool:
    """DSV41_MLX_KERNELS=0, read once a process: a decode step asks backend ~230 times, too
    often to read the environment each time."""
    return os.environ.get("DSV41_MLX_KERNELS", "1") == "0"


def compiled(spec: KernelSpec, language: str):
    """spec's kernel for `language` ('metal' or 'cuda'), from the dispatch's builder."""
    build = _dispatch.get().build
    return compile_kernel(spec, language) if build is None else build(spec, language)


@lru_cache(maxsize=None)
def compile_kernel(spec: KernelSpec, language: str):
    """spec's kernel for `language`, built once. MLX 0.32's CUDA backend hashes a custom kernel's whole text
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


# ---------------------------------------------------------- launch arguments

@lru_cache(maxsize=4096)
def constant(dtype: mx.Dtype, *values) -> mx.array:
    """A kernel's small argument (sizes, row counts, epsilons: a few values per model), made
    and evaluated once per value and shared by every later call, so that a forward allocates
    no argument arrays on the host (on CUDA, MLX's allocator may hand a host allocation a
    device buffer from its cache and copy it to managed memory, which waits for the device)."""
    a = mx.array(values, dtype=dtype)
    mx.eval(a)
    return a


def int32s(*values: int) -> mx.array:
    return constant(mx.int32, *values)


def float32s(*values: float) -> mx.array:
    return constant(mx.float32, *values)


def computed_rows(real_rows: int | None, rows: int) -> int:
    """How many of a forward's rows a kernel that can skip padding computes: the real ones
    (a padded forward's, Runner.padded), or all where real_rows is None."""
    return rows if real_rows is None else min(real_rows, rows)
