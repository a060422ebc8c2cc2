"""Run a GPU kernel body, Metal or CUDA, on the host, for a machine without either GPU.

The body and its headers become C++ against tests/emulation/metal_emu.h or cuda_emu.h:
Metal's address-space words dropped and its threadgroup arrays made static storage; CUDA's
inline PTX (fp16_bits.cuh: fp16 conversions and the matrix unit's mma_m16n8k16) left out for
the emulation's functions of the same names. The template constants become file-scope constants,
and a main reads each input from a file, runs the grid of 256-thread threadgroups (blocks) one
after another and writes the outputs. clang++ builds it (tests/compiler.py: else the clang of
the `ziglang` test extra); numpy carries the arrays. The type-check and the NVRTC compile
(tests/test_kernels.py) catch a wrong name or type; this catches a wrong index, a wrong layout, a wrong fragment: the kernel's numbers against its spec.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np

from dsv41_mlx.kernels import kernel_text
from tests.compiler import cxx

EMULATION = Path(__file__).parent / "emulation"
C_TYPES = {"metal": {"bfloat16": "bfloat16_t", "float32": "float", "uint32": "uint", "uint16": "uint16_t",
                     "uint8": "uint8_t", "int32": "int"},
           "cuda": {"bfloat16": "__nv_bfloat16", "float32": "float", "uint32": "unsigned int", "uint16": "uint16_t",
                    "uint8": "uint8_t", "int32": "int"}}
NP_TYPES = {"bfloat16": np.uint16, "float32": np.float32, "uint32": np.uint32, "uint16": np.uint16, "uint8": np.uint8,
            "int32": np.int32}
# Functions an emulation header defines in the global namespace for libstdc++ (GCC's, clang++'s
# on Linux) that libc++ (zig's clang, macOS) declares there already: its <math.h> has `using
# std::__math::fma` and `isnan`, and a definition beside a using-declaration does not compile.
# With libc++ the header's own is renamed away (it calls std's, as the library's does).
LIBCXX_CLASHES = {"metal": {"fma": ("float", "float a, float b, float c", "a, b, c")},
                  "cuda": {"isnan": ("bool", "float v", "v")}}
HEADERS = ("algorithm", "atomic", "barrier", "cmath", "cstdint", "cstdio", "cstring", "thread", "vector")


def metal_host_text(metal: str) -> str:
    """Metal text as C++ for metal_emu.h: `threadgroup T name[..];` becomes static storage,
    and the address-space qualifiers go."""
    out = []
    for line in metal.splitlines():
        if re.match(r"\s*threadgroup\s+\w+\s+\w+\s*(\[[^\]]*\])*\s*;", line):
            line = re.sub(r"^(\s*)threadgroup\s+", r"\1static ", line)
        line = re.sub(r"\b(threadgroup|device|constant|thread)\b\s+(?=[\w(])", "", line)
        out.append(line)
    return "\n".join(out)


def unit(spec, language: str, inputs: dict[str, str], outputs: dict[str, tuple[str, int]],
         template: dict[str, int | str], groups: int, read_back: tuple[str, ...] = ()) -> str:
    """The C++ translation unit: inputs/outputs name -> dtype (outputs with their sizes);
    read_back: inputs written out after the run as well (a kernel that writes into an input)."""
    types = C_TYPES[language]
    params = [f"const {types[t]}* {n}" for n, t in inputs.items()] + [f"{types[t]}* {n}" for n, (t, _) in outputs.items()]
    if language == "metal":
        header, body, run_grid = metal_host_text(spec.header("metal")), metal_host_text(spec.source("metal")), \
            "run_threadgroups"
    else:  # fp16_bits.cuh (inline PTX) left out: cuda_emu.h has its functions
        header = spec.header("cuda").replace(kernel_text("fp16_bits.cuh"), "")
        body, run_grid = spec.source("cuda"), "run_blocks"
    clashes = LIBCXX_CLASHES[language]
    lines = [f"#include <{h}>" for h in HEADERS]  # (before the renames, which must not reach them)
    lines += ["#ifdef _LIBCPP_VERSION", "namespace std {"]
    lines += [f"inline {r} dsv41_emu_{f}({p}) {{ return {f}({a}); }}" for f, (r, p, a) in clashes.items()]
    lines += ["}"] + [f"#define {f} dsv41_emu_{f}" for f in clashes] + ["#endif"]
    lines += [f'#include "{EMULATION / (language + "_emu.h")}"']
    lines += ["#ifdef _LIBCPP_VERSION"] + [f"#undef {f}" for f in clashes] + ["#endif"]
    lines += [f"using {k} = {types[v]};" if isinstance(v, str) else f"constexpr int {k} = {v};"
              for k, v in template.items()]  # a type parameter ('bfloat16', ...) or an int constant
    lines += [header, "void kernel_body(" + ", ".join(params) + ") {", body, "}"]
    lines += ["template <typename T> std::vector<T> read(const char* path) {",
              '  FILE* f = std::fopen(path, "rb"); std::vector<T> v; T t;',
              "  while (std::fread(&t, sizeof(T), 1, f) == 1) v.push_back(t);",
              "  std::fclose(f); return v; }", "int main() {"]
    lines += [f'  auto {n}_v = read<{types[t]}>("{n}.bin");' for n, t in inputs.items()]
    lines += [f"  std::vector<{types[t]}> {n}_v({size});" for n, (t, size) in outputs.items()]
    args = ", ".join(f"{n}_v.data()" for n in list(inputs) + list(outputs))
    lines.append(f"  {run_grid}({groups}, [&] {{ kernel_body({args}); }});")
    written = {**outputs, **{n: (None, f"{n}_v.size()") for n in read_back}}
    lines += [f'  {{ FILE* f = std::fopen("{n}.out", "wb"); std::fwrite({n}_v.data(), sizeof({n}_v[0]), {size}, f); '
              "std::fclose(f); }" for n, (t, size) in written.items()]
    return "\n".join(lines + ["  return 0;", "}"]) + "\n"


def run(spec, language: str, inputs: dict[str, tuple[str, np.ndarray]], outputs: dict[str, tuple[str, int]],
        template: dict[str, int | str], groups: int, workdir: Path,
        read_back: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Build and run `spec`'s body in `language` ('metal' or 'cuda') on the host: inputs name
    -> (dtype, array), outputs name -> (dtype, element count); returns the outputs as flat
    numpy arrays (bfloat16 as their uint16 bits), and the inputs named in read_back as the
    kernel left them."""
    for n, (t, a) in inputs.items():
        np.ascontiguousarray(a, dtype=NP_TYPES[t]).tofile(workdir / f"{n}.bin")
    source = workdir / "kernel.cpp"
    source.write_text(unit(spec, language, {n: t for n, (t, _) in inputs.items()}, outputs, template, groups,
                           read_back))
    if cxx() is None:
        raise RuntimeError("no C++ compiler: install clang++ or the test extras (ziglang)")
    build = subprocess.run([cxx(), "-std=c++20", "-O1", "-pthread", "-w", str(source), "-o", str(workdir / "kernel")],
                           capture_output=True, text=True)
    if build.returncode:
        raise RuntimeError(f"the host build of {spec.name} ({language}) failed:\n{build.stderr[-3000:]}")
    subprocess.run([str(workdir / "kernel")], cwd=workdir, check=True, timeout=300)
    kinds = {**{n: t for n, (t, _) in outputs.items()}, **{n: inputs[n][0] for n in read_back}}
    return {n: np.fromfile(workdir / f"{n}.out", dtype=NP_TYPES[t]) for n, t in kinds.items()}
