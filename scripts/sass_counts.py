"""The machine code NVRTC makes of fp4_experts' walk, counted by instruction, on a machine without a GPU.

    python scripts/sass_counts.py [--arch sm_90] [--set U=1 ...] [--list VARIANT]

For each variant a forward launches (w13 with its SwiGLU and w2, at one row and at six rows:
the template arguments kernels.fp4_experts picks), compiles metal_kernels/fp4_experts.cu as MLX
wraps it (scripts/kernel_checks/nvrtc.py) to a cubin, disassembles it with `nvdisasm` (the PyPI wheel
nvidia-cuda-nvdisasm) and finds the walk: the innermost loop holding the matrix-unit products
(HMMA). Prints the loop's warp instructions per 32-column block of 32 weight rows (512 bytes
of codes; the loop body covers U blocks), by opcode, and the registers a thread takes.
--set KEY=VALUE overrides a template constant in every variant (e.g. U: what a choice in
kernels would compile to). --list VARIANT prints the loop's instructions. Needs the test extras'
NVRTC wheels.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41_mlx import kernels  # noqa: E402
from dsv41_mlx.kernels import tuning  # noqa: E402
from scripts.kernel_checks import nvrtc  # noqa: E402
from scripts.kernel_checks.cases import experts_case  # noqa: E402

W13_K, W2_K = 5120, 2304  # the release's: hidden, and the experts' inner width


def variants(overrides: dict[str, int] | None = None) -> dict[str, tuple]:
    """The forward's fp4_experts launches (model.MoE._routed_rows: w13 on x already quantised,
    its weighted SwiGLU; w2 quantising h itself): name -> the kernel case (scripts/kernel_checks/cases.py)
    with kernels.fp4_experts_template's constants and `overrides` of them."""
    out = {}
    for rows in (1, 6):
        for name, sw, k, quantize in (("w13", 2, W13_K, False), ("w2", 0, W2_K, True)):
            template = dict(kernels.fp4_experts_template(rows, k, quantize, sw,
                                                         tuning.current().experts_prepare_x(rows)))
            out[f"{name}, {rows} row{'s' * (rows > 1)}"] = experts_case(**{**template, **(overrides or {})})
    return out


def nvdisasm() -> str:
    """The nvdisasm binary: on PATH, or the nvidia-cuda-nvdisasm wheel's."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations if spec else []):
        for path in sorted(Path(base).glob("cu*/bin/nvdisasm")):
            return str(path)
    raise SystemExit("needs nvdisasm: pip install nvidia-cuda-nvdisasm")


def cubin(case: tuple, arch: str) -> tuple[bytes, int]:
    """NVRTC's cubin of the kernel case for `arch` (an sm_ target), and its registers a thread."""
    spec, inputs, outputs, template = case
    source = nvrtc.wrap(spec.name, spec.source("cuda"), spec.header("cuda"), inputs, outputs, template)
    compiled, log, code = nvrtc.compile_cubin(source, arch, ("--ptxas-options=-v",))
    if not compiled:
        raise RuntimeError(f"{spec.name} {template}: NVRTC failed:\n{log}")
    regs = re.search(r"Used (\d+) registers", log)
    return code, int(regs.group(1)) if regs else -1


INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)[^;]*;")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH = re.compile(r"\bBRA\b[^;]*?(\.L_x_\d+)")


def listing(code: bytes) -> list[tuple[str | None, str | None, str]]:
    """nvdisasm's text of a cubin: (label or None, opcode or None, line) a line, in order."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(code)
        f.flush()
        text = subprocess.run([nvdisasm(), "-c", f.name], check=True, capture_output=True, text=True).stdout
    out = []
    for line in text.splitlines():
        label, op = LABEL.match(line), INSTRUCTION.match(line)
        out.append((label.group(1) if label else None, op.group(1) if op else None, line))
    return out


def walk_loop(lines: list) -> list[str]:
    """The innermost loop holding HMMA: the lines from the label a backward branch goes to
    through that branch, the shortest such span with an HMMA in it."""
    where = {label: i for i, (label, _, _) in enumerate(lines) if label}
    best = None
    for i, (_, op, line) in enumerate(lines):
        target = BRANCH.search(line) if op and op.startswith("BRA") else None
        if target and where.get(target.group(1), i) < i:
            span = lines[where[target.group(1)]:i + 1]
            if any(o and o.startswith("HMMA") for _, o, _ in span) and (best is None or len(span) < len(best)):
                best = span
    if best is None:
        raise RuntimeError("no loop with HMMA found")
    return [line for _, op, line in best if op]


def opcode(line: str) -> str:
    return INSTRUCTION.match(line).group(1).split(".")[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90", help="NVRTC's target (sm_90: H100/H200)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a template constant for every variant (U, ...)")
    parser.add_argument("--list", metavar="VARIANT", help="print this variant's loop (a name from the table)")
    args = parser.parse_args()
    overrides = {k: int(v) for k, v in (item.split("=", 1) for item in args.set)}
    if nvrtc.nvrtc() is None:
        print("needs the NVRTC wheels: pip install -e '.[test]'", file=sys.stderr)
        return 2
    found = {}
    for name, case in variants(overrides).items():
        code, regs = cubin(case, args.arch)
        loop = walk_loop(listing(code))
        blocks = case[3]["U"]  # the loop's turn sums U blocks
        found[name] = (loop, blocks, regs)
        if args.list == name:
            print("\n".join(loop))
    if args.list:
        if args.list not in found:
            print(f"no variant {args.list!r}; one of {sorted(found)}", file=sys.stderr)
            return 2
        return 0
    counts = {name: collections.Counter(opcode(line) for line in loop) for name, (loop, _, _) in found.items()}
    ops = sorted(set().union(*counts.values()), key=lambda o: -sum(c[o] for c in counts.values()))
    names = list(found)
    print(f"fp4_experts' walk on {args.arch}{''.join(f', {k} {v}' for k, v in overrides.items())}: "
          "warp instructions a 512-byte block (the loop's / the blocks it covers)\n")
    print("| opcode | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    print("| registers | " + " | ".join(str(found[n][2]) for n in names) + " |")
    print("| blocks a loop | " + " | ".join(str(found[n][1]) for n in names) + " |")
    print("| **all** | " + " | ".join(f"**{len(found[n][0]) / found[n][1]:.1f}**" for n in names) + " |")
    for op in ops:
        print(f"| {op} | " + " | ".join(f"{counts[n][op] / found[n][1]:.1f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
