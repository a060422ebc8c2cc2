"""Type-check Metal kernel bodies on a machine without Metal.

MLX's `mx.fast.metal_kernel` turns a body into a kernel function: the inputs
become `const device T* name [[buffer(i)]]` parameters, the outputs
`device T* name [[buffer(i)]]`, every thread attribute the body names becomes a
parameter with that attribute, template arguments become template parameters of
the function, and one explicit instantiation names the specialisation. We write
the same text around our bodies and compile it with clang as C++17 against a
small shim of the Metal language (tests/metal_shim/metal_shim.h): a misspelt
name, a wrong type or a missing semicolon in the body fails the compile. The
clang is clang++ where installed, else the one of the `ziglang` test extra
(tests/compiler.py).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.compiler import cxx

SHIM = Path(__file__).parent / "metal_shim" / "metal_shim.h"
SHIM_INCLUDE = '#include "metal_shim.h"'

ATTRIBUTES = {  # the thread attributes MLX recognises, with their parameter types
    "thread_position_in_grid": "uint3", "threadgroup_position_in_grid": "uint3",
    "thread_position_in_threadgroup": "uint3", "threads_per_threadgroup": "uint3",
    "threadgroups_per_grid": "uint3", "thread_index_in_threadgroup": "uint",
    "thread_index_in_simdgroup": "uint", "simdgroup_index_in_threadgroup": "uint",
    "threads_per_simdgroup": "uint", "simdgroups_per_threadgroup": "uint",
}
TYPE_NAMES = {"bool": "bool", "float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t",
              "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "int32": "int32_t", "int64": "int64_t"}


def clang() -> str | None:
    """The clang++ command (tests/compiler.py): clang++, else zig's; None without either."""
    return cxx()


def wrap(name: str, body: str, header: str, inputs: dict[str, str], outputs: dict[str, str],
         template: dict[str, int]) -> str:
    """The Metal library text MLX would build: header, the kernel function, its instantiation.

    inputs/outputs: parameter name -> dtype name ('float32', 'uint8', ...); template:
    name -> int, or name -> dtype name for a type parameter."""
    params = [f"const device {TYPE_NAMES[t]}* {n} [[buffer({i})]]" for i, (n, t) in enumerate(inputs.items())]
    params += [f"device {TYPE_NAMES[t]}* {n} [[buffer({len(inputs) + i})]]" for i, (n, t) in enumerate(outputs.items())]
    params += [f"{t} {a} [[{a}]]" for a, t in ATTRIBUTES.items() if a in body]
    fn = f"custom_kernel_{name}"
    # template values: an int constant, or a dtype name ('bfloat16', ...) for a type parameter
    args = ", ".join(TYPE_NAMES[v] if isinstance(v, str) else str(v) for v in template.values())
    lines = [SHIM_INCLUDE, "using namespace metal;", header]
    if template:
        lines.append("template <" + ", ".join(f"typename {k}" if isinstance(v, str) else f"int {k}"
                                              for k, v in template.items()) + ">")
    lines.append(f"[[kernel]] void {fn}(\n  " + ",\n  ".join(params) + ") {\n" + body + "\n}")
    if template:  # MLX's line also carries [[host_name(..)]] [[kernel]], which C++ does not allow there
        lines.append(f"template decltype({fn}<{args}>) {fn}<{args}>;")
    return "\n".join(lines) + "\n"


def syntax_check(source: str, workdir: Path) -> subprocess.CompletedProcess:
    """clang -fsyntax-only on the wrapped source; returncode 0 when it type-checks."""
    path = workdir / "kernel.metal.cpp"
    path.write_text(source)
    if clang() is None:
        raise RuntimeError("no C++ compiler: install clang++ or the test extras (ziglang)")
    return subprocess.run([clang(), "-std=c++17", "-fsyntax-only", "-Wno-unknown-attributes",
                           "-Wno-ignored-attributes", "-I", str(SHIM.parent), str(path)],
                          capture_output=True, text=True, timeout=120)


def syntax_check_all(sources: list[str], workdir: Path) -> subprocess.CompletedProcess:
    """syntax_check of several wrapped sources in one clang run: each in a namespace of its own,
    the macros it defines undefined after it, so that each meets only what it meets alone.
    returncode 0 when all type-check; a failure does not say which (syntax_check each alone)."""
    blocks = [SHIM_INCLUDE]
    for i, source in enumerate(sources):
        own = source.replace(SHIM_INCLUDE + "\n", "", 1)
        blocks += [f"namespace source_{i} {{", own, "}"]
        blocks += [f"#undef {m}" for m in re.findall(r"^\s*#\s*define\s+(\w+)", own, re.MULTILINE)]
    return syntax_check("\n".join(blocks) + "\n", workdir)
