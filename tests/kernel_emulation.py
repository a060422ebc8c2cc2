"""Run a GPU kernel body, Metal or CUDA, on the host, for a machine without either GPU.

The body and its headers become C++ against tests/emulation/metal_emu.h or cuda_emu.h:
Metal's address-space words dropped and its threadgroup arrays made static storage; CUDA's
inline PTX (fp16_bits.cuh: fp16 conversions and the matrix unit's mma_m16n8k16) left out for
the emulation's functions of the same names. The template constants become file-scope
constants, and a main reads each input from a file, runs the grid of 256-thread threadgroups
(blocks) one after another, each thread a fiber (tests/emulation/fibers.h), and writes the
outputs; the grid's size and the outputs' sizes are its arguments, so one build serves every
launch of the same text. clang++ builds it (tests/compiler.py: else the clang of the `ziglang`
test extra), once a session for each text; numpy carries the arrays. The type-check and the
NVRTC compile (tests/test_kernels.py) catch a wrong name or type; this catches a wrong index,
a wrong layout, a wrong fragment: the kernel's numbers against its spec.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np

from dsv41_mlx.kernels import kernel_text
from tests.compiler import cxx

EMULATION = Path(__file__).parent / "emulation"
C_TYPES = {"metal": {"bfloat16": "bfloat16_t", "float32": "float", "uint32": "uint", "uint16": "uint16_t",
                     "uint8": "uint8_t", "int32": "int", "bool": "bool"},
           "cuda": {"bfloat16": "__nv_bfloat16", "float32": "float", "uint32": "unsigned int", "uint16": "uint16_t",
                    "uint8": "uint8_t", "int32": "int", "bool": "bool"}}
NP_TYPES = {"bfloat16": np.uint16, "float32": np.float32, "uint32": np.uint32, "uint16": np.uint16, "uint8": np.uint8,
            "int32": np.int32, "bool": np.bool_}
FLAGS = ("-std=c++20", "-O1", "-w", "-I", str(EMULATION))
MAIN = r"""struct Buffer { void* data; long bytes; };
Buffer read_file(const char* path) {
  FILE* f = std::fopen(path, "rb");
  if (f == nullptr) { std::perror(path); std::abort(); }
  std::fseek(f, 0, SEEK_END);
  const long bytes = std::ftell(f);
  std::rewind(f);
  void* data = std::malloc(bytes + 16);
  if (std::fread(data, 1, bytes, f) != size_t(bytes)) std::abort();
  std::fclose(f);
  return {data, bytes};
}
void write_file(const char* path, const void* data, long bytes) {
  FILE* f = std::fopen(path, "wb");
  std::fwrite(data, 1, bytes, f);
  std::fclose(f);
}
"""


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


def unit(spec, language: str, inputs: dict[str, str], outputs: dict[str, str], template: dict[str, int | str],
         read_back: tuple[str, ...] = ()) -> str:
    """The C++ translation unit: inputs/outputs name -> dtype; read_back: inputs written out
    after the run as well (a kernel that writes into an input). Its main takes the number of
    threadgroups, then each output's element count."""
    types = C_TYPES[language]
    params = [f"const {types[t]}* {n}" for n, t in inputs.items()] + [f"{types[t]}* {n}" for n, t in outputs.items()]
    if language == "metal":
        header, body, run_grid = metal_host_text(spec.header("metal")), metal_host_text(spec.source("metal")), \
            "run_threadgroups"
    else:  # fp16_bits.cuh (inline PTX) left out: cuda_emu.h has its functions
        header = spec.header("cuda").replace(kernel_text("fp16_bits.cuh"), "")
        body, run_grid = spec.source("cuda"), "run_blocks"
    lines = [f'#include "{language}_emu.h"', "#include <cstdio>", "#include <cstdlib>"]
    lines += [f"using {k} = {types[v]};" if isinstance(v, str) else f"constexpr int {k} = {v};"
              for k, v in template.items()]  # a type parameter ('bfloat16', ...) or an int constant
    lines += [header, "void kernel_body(" + ", ".join(params) + ") {", body, "}", MAIN]
    lines.append("int main(int argc, char** argv) {")
    lines += [f'  const Buffer {n}_in = read_file("{n}.bin");' for n in inputs]
    lines += [f"  const long {n}_size = std::atol(argv[{2 + i}]);\n"
              f"  auto* {n}_out = static_cast<{types[t]}*>(std::calloc({n}_size + 1, sizeof({types[t]})));"
              for i, (n, t) in enumerate(outputs.items())]
    args = [f"static_cast<const {types[t]}*>({n}_in.data)" for n, t in inputs.items()] + [f"{n}_out" for n in outputs]
    lines.append(f"  {run_grid}(std::atoi(argv[1]), [&] {{ kernel_body({', '.join(args)}); }});")
    lines += [f'  write_file("{n}.out", {n}_out, {n}_size * sizeof({types[t]}));' for n, t in outputs.items()]
    lines += [f'  write_file("{n}.out", {n}_in.data, {n}_in.bytes);' for n in read_back]
    return "\n".join(lines + ["  return 0;", "}"]) + "\n"


@lru_cache(maxsize=None)
def _builds() -> Path:
    """This session's folder of built emulations (removed at exit)."""
    folder = Path(tempfile.mkdtemp(prefix="dsv41-emulation-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@lru_cache(maxsize=None)
def _builders() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1)


def _compile(text: str, name: str) -> Path:
    if cxx() is None:
        raise RuntimeError("no C++ compiler: install clang++ or the test extras (ziglang)")
    source = _builds() / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.cpp"
    source.write_text(text)
    done = subprocess.run([cxx(), *FLAGS, str(source), "-o", str(source.with_suffix(""))],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the host build of {name} failed:\n{done.stderr[-3000:]}")
    return source.with_suffix("")


@lru_cache(maxsize=None)
def _build(text: str, name: str) -> Future:
    """The executable of a unit's text (a Future of its path): built once a session, beside the
    other builds (up to a core each). name: what the text is, for a failure's message."""
    return _builders().submit(_compile, text, name)


def start(spec, language: str, inputs: dict[str, tuple[str, np.ndarray]], outputs: dict[str, tuple[str, int]],
          template: dict[str, int | str], groups: int, workdir: Path,
          read_back: tuple[str, ...] = ()) -> Callable[[], dict[str, np.ndarray]]:
    """run()'s launch with its build begun: call what it returns to run it. A test of several
    launches starts them all first, so that their builds run side by side."""
    executable = _build(unit(spec, language, {n: t for n, (t, _) in inputs.items()},
                             {n: t for n, (t, _) in outputs.items()}, template, read_back), f"{spec.name} ({language})")

    def finish() -> dict[str, np.ndarray]:
        for n, (t, a) in inputs.items():
            np.ascontiguousarray(a, dtype=NP_TYPES[t]).tofile(workdir / f"{n}.bin")
        subprocess.run([str(executable.result()), str(groups), *(str(size) for _, size in outputs.values())],
                       cwd=workdir, check=True, timeout=300)
        kinds = {**{n: t for n, (t, _) in outputs.items()}, **{n: inputs[n][0] for n in read_back}}
        return {n: np.fromfile(workdir / f"{n}.out", dtype=NP_TYPES[t]) for n, t in kinds.items()}

    return finish


def run(spec, language: str, inputs: dict[str, tuple[str, np.ndarray]], outputs: dict[str, tuple[str, int]],
        template: dict[str, int | str], groups: int, workdir: Path,
        read_back: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Build and run `spec`'s body in `language` ('metal' or 'cuda') on the host: inputs name
    -> (dtype, array), outputs name -> (dtype, element count); returns the outputs as flat
    numpy arrays (bfloat16 as their uint16 bits), and the inputs named in read_back as the
    kernel left them."""
    return start(spec, language, inputs, outputs, template, groups, workdir, read_back)()
