"""Compile CUDA kernel bodies with NVRTC on a machine without a GPU.

MLX's `mx.fast.cuda_kernel` turns a body into a `__global__` function whose
parameters are the inputs (`const T* name`) then the outputs (`T* name`), with
the template arguments as template parameters. We write the same around our
bodies and compile them to PTX or a cubin with NVRTC (the `nvidia-cuda-nvrtc-cu12`
wheel; headers from `nvidia-cuda-runtime-cu12`), which needs no GPU: a misspelt
name, a wrong type or a bad intrinsic call in a body fails the compile
(tests/test_kernels.py), and ptxas reports a variant's registers
(scripts/gemv_registers.py, scripts/sass_counts.py).
"""

from __future__ import annotations

import ctypes
import importlib.util
from functools import lru_cache
from pathlib import Path

TYPE_NAMES = {"bool": "bool", "float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16",
              "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "int32": "int32_t"}
PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
"""


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


@lru_cache(maxsize=None)
def nvrtc() -> tuple[ctypes.CDLL, Path] | None:
    """(libnvrtc, the CUDA include directory), or None when the wheels are not installed."""
    lib_dir, runtime = _package_dir("nvidia.cuda_nvrtc"), _package_dir("nvidia.cuda_runtime")
    if lib_dir is None or runtime is None:
        return None
    libs = sorted((lib_dir / "lib").glob("libnvrtc.so*"))
    return (ctypes.CDLL(str(libs[0])), runtime / "include") if libs else None


def wrap(name: str, body: str, header: str, inputs: dict[str, str], outputs: dict[str, str],
         template: dict[str, int | str]) -> str:
    """The translation unit: prelude, header, the kernel, and its instantiation.
    template: name -> int, or name -> dtype name for a type parameter."""
    def type_of(v):
        return TYPE_NAMES[v] if isinstance(v, str) else str(v)

    params = [f"const {TYPE_NAMES[t]}* {n}" for n, t in inputs.items()]
    params += [f"{TYPE_NAMES[t]}* {n}" for n, t in outputs.items()]
    lines = [PRELUDE, header]
    if template:
        lines.append("template <" + ", ".join(f"typename {k}" if isinstance(v, str) else f"int {k}"
                                              for k, v in template.items()) + ">")
    lines.append(f"__global__ void {name}(" + ", ".join(params) + ") {\n" + body + "\n}")
    if template:
        args = ", ".join(type_of(v) for v in template.values())
        lines.append(f"template __global__ void {name}<{args}>(" +
                     ", ".join(p.rsplit(" ", 1)[0] for p in params) + ");")
    return "\n".join(lines) + "\n"


def compile_cuda(source: str, arch: str = "compute_90", extra: tuple[str, ...] = ()) -> tuple[bool, str]:
    """NVRTC on the source: (compiled, log). extra: more options (e.g. ptxas' -v with an sm_ arch)."""
    compiled, log, _ = compile_cubin(source, arch, extra)
    return compiled, log


def compile_cubin(source: str, arch: str = "sm_90", extra: tuple[str, ...] = ()) -> tuple[bool, str, bytes]:
    """compile_cuda's (compiled, log) and the machine code NVRTC made (a cubin where arch is an sm_
    target; empty where it did not compile)."""
    lib, include = nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None):
        return False, "nvrtcCreateProgram failed", b""
    options = [f"--gpu-architecture={arch}", f"-I{include}", "-std=c++17", *extra]
    status = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(
        *[o.encode() for o in options]))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    code = b""
    if status == 0 and arch.startswith("sm_"):
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        code = cubin.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return status == 0, log.value.decode(errors="replace"), code
