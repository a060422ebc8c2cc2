"""Run a Metal kernel body on the host, for a machine without Metal.

The body and its headers are turned into C++ against tests/metal_shim/metal_emu.h (Metal's
address-space words dropped, threadgroup arrays made static storage, the template constants
file-scope constants), with a main that reads each input from a file, runs the grid of
256-thread threadgroups and writes the outputs. clang++ builds it; numpy carries the arrays.
The type-check (metal_check.py) catches a wrong name or type; this catches a wrong index, a
missing barrier's effect on the data, a wrong layout: the kernel's numbers against its spec.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np

from tests.metal_check import clang

EMU = Path(__file__).parent / "metal_shim" / "metal_emu.h"
C_TYPES = {"bfloat16": "bfloat16_t", "float32": "float", "uint32": "uint", "uint8": "uint8_t", "int32": "int"}
NP_TYPES = {"bfloat16": np.uint16, "float32": np.float32, "uint32": np.uint32, "uint8": np.uint8, "int32": np.int32}


def host_text(metal: str) -> str:
    """Metal text as C++ for metal_emu.h: `threadgroup T name[..];` becomes static storage,
    and the address-space qualifiers go."""
    out = []
    for line in metal.splitlines():
        if re.match(r"\s*threadgroup\s+\w+\s+\w+\s*(\[[^\]]*\])*\s*;", line):
            line = re.sub(r"^(\s*)threadgroup\s+", r"\1static ", line)
        line = re.sub(r"\b(threadgroup|device|constant|thread)\b\s+(?=[\w(])", "", line)
        out.append(line)
    return "\n".join(out)


def unit(header: str, body: str, inputs: dict[str, str], outputs: dict[str, tuple[str, int]],
         template: dict[str, int], groups: int) -> str:
    """The C++ translation unit: inputs/outputs name -> dtype (outputs with their sizes)."""
    params = [f"const {C_TYPES[t]}* {n}" for n, t in inputs.items()]
    params += [f"{C_TYPES[t]}* {n}" for n, (t, _) in outputs.items()]
    lines = [f'#include "{EMU}"', "#include <cstdio>"]
    lines += [f"constexpr int {k} = {v};" for k, v in template.items()]
    lines += [host_text(header), "void kernel_body(" + ", ".join(params) + ") {", host_text(body), "}"]
    lines.append("template <typename T> std::vector<T> read(const char* path) {")
    lines.append("  FILE* f = std::fopen(path, \"rb\"); std::vector<T> v; T t;")
    lines.append("  while (std::fread(&t, sizeof(T), 1, f) == 1) v.push_back(t);")
    lines.append("  std::fclose(f); return v; }")
    lines.append("int main() {")
    for n, t in inputs.items():
        lines.append(f'  auto {n}_v = read<{C_TYPES[t]}>("{n}.bin");')
    for n, (t, size) in outputs.items():
        lines.append(f"  std::vector<{C_TYPES[t]}> {n}_v({size});")
    args = ", ".join(f"{n}_v.data()" for n in list(inputs) + list(outputs))
    lines.append(f"  run_threadgroups({groups}, [&] {{ kernel_body({args}); }});")
    for n, (t, size) in outputs.items():
        lines.append(f'  {{ FILE* f = std::fopen("{n}.out", "wb"); std::fwrite({n}_v.data(), sizeof({n}_v[0]), {size}, f); '
                     "std::fclose(f); }")
    lines.append("  return 0;\n}")
    return "\n".join(lines) + "\n"


def run(spec, inputs: dict[str, tuple[str, np.ndarray]], outputs: dict[str, tuple[str, int]],
        template: dict[str, int], groups: int, workdir: Path) -> dict[str, np.ndarray]:
    """Build and run `spec`'s Metal body on the host: inputs name -> (dtype, array), outputs
    name -> (dtype, element count); returns the outputs as flat numpy arrays (bfloat16 as
    their uint16 bits)."""
    for n, (t, a) in inputs.items():
        np.ascontiguousarray(a, dtype=NP_TYPES[t]).tofile(workdir / f"{n}.bin")
    source = workdir / "kernel.cpp"
    source.write_text(unit(spec.header("metal"), spec.source("metal"), {n: t for n, (t, _) in inputs.items()},
                           outputs, template, groups))
    build = subprocess.run([clang(), "-std=c++20", "-O1", "-pthread", "-w", str(source), "-o", str(workdir / "kernel")],
                           capture_output=True, text=True)
    if build.returncode:
        raise RuntimeError(f"the host build of {spec.name} failed:\n{build.stderr[-3000:]}")
    subprocess.run([str(workdir / "kernel")], cwd=workdir, check=True, timeout=300)
    return {n: np.fromfile(workdir / f"{n}.out", dtype=NP_TYPES[t]) for n, (t, _) in outputs.items()}
