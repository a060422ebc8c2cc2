"""Registers a thread of each GEMV kernel variant takes on an NVIDIA GPU, from NVRTC.

    python scripts/gemv_registers.py [--arch sm_90]

Compiles fp8_gemv, fp4_experts, fp8_mma and fp8_mma_hc (metal_kernels/*.cu, wrapped as MLX wraps them:
scripts/kernel_checks/nvrtc.py) for the layouts a forward picks (fp8_gemv: Layout.gemv_layout, RB 1
with T 4, RB 2 and 8 with T 2; fp4_experts and fp8_mma: Layout.mma_column_groups, NH 1 and 2) with
and without each epilogue (SW: the SwiGLU, AP: the added parts, QX: the input quantised in
the kernel), and prints NVRTC's register count per thread and how many threadgroups of 256
threads a core then holds (65,536 registers).
Needs no GPU: the test extras' NVRTC wheel.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.kernel_checks import nvrtc  # noqa: E402
from scripts.kernel_checks.cases import experts_case, gemv_case, mma_case, mma_hc_case  # noqa: E402

LAYOUTS = ((1, 4, 32), (2, 2, 32), (8, 2, 64))  # (RB, T, C)
EXPERTS_LAYOUTS = (1, 2)  # NH
GEMV_VARIANTS = {"plain": {}, "SW": {"SW": 1}, "QX": {"QX": 1}, "AP 6": {"AP": 6}, "AP 6, QX": {"AP": 6, "QX": 1}}
EXPERTS_VARIANTS = {"plain": {}, "SW (weighted)": {"SW": 2}, "QX": {"QX": 1}, "QX, one row": {"QX": 1, "ONE": 1}}
MMA_VARIANTS = {**GEMV_VARIANTS, "QX, one row": {"QX": 1, "ONE": 1}}
MMA_HC_VARIANTS = {"QX, one row": {"QX": 1, "ONE": 1}, "QX": {"QX": 1}, "AP 6": {"AP": 6}}  # wo_b's, the shared w2's


def registers(case: tuple, arch: str) -> int:
    """NVRTC's count of registers a thread of the kernel variant takes."""
    spec, inputs, outputs, template = case
    source = nvrtc.wrap(spec.name, spec.source("cuda"), spec.header("cuda"), inputs, outputs, template)
    ok, log = nvrtc.compile_cuda(source, arch, ("--ptxas-options=-v",))
    found = re.search(r"Used (\d+) registers", log)
    if not ok or not found:
        raise RuntimeError(f"{spec.name} {template}: NVRTC gave no register count:\n{log}")
    return int(found.group(1))


def table(arch: str, layouts=LAYOUTS, experts_layouts=EXPERTS_LAYOUTS) -> list[dict]:
    """One row per (kernel, layout, variant): registers and threadgroups a core holds."""
    cases = [("fp8_gemv", f"RB {rb}, T {t}, C {c}", GEMV_VARIANTS,
              lambda extra, rb=rb, t=t, c=c: gemv_case(RB=rb, T=t, C=c, **extra)) for rb, t, c in layouts]
    cases += [("fp4_experts", f"NH {nh}", EXPERTS_VARIANTS, lambda extra, nh=nh: experts_case(NH=nh, **extra))
              for nh in experts_layouts]
    cases += [("fp8_mma", f"NH {nh}", MMA_VARIANTS, lambda extra, nh=nh: mma_case(NH=nh, **extra))
              for nh in experts_layouts]
    cases += [("fp8_mma_hc", f"NH {nh}", MMA_HC_VARIANTS, lambda extra, nh=nh: mma_hc_case(NH=nh, **extra))
              for nh in experts_layouts]
    rows = []
    for kernel, layout, variants, make in cases:
        for label, extra in variants.items():
            n = registers(make(extra), arch)
            rows.append({"kernel": kernel, "layout": layout, "variant": label, "registers": n,
                         "threadgroups_per_core": 65536 // (256 * n)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90", help="NVRTC's target (sm_90: H100/H200)")
    args = parser.parse_args()
    if nvrtc.nvrtc() is None:
        print("needs the NVRTC wheels: pip install -e '.[test]'", file=sys.stderr)
        return 2
    print("| kernel | layout | variant | registers | threadgroups a core |\n|---|---|---|---|---|")
    for r in table(args.arch):
        print(f"| {r['kernel']} | {r['layout']} | {r['variant']} | {r['registers']} | {r['threadgroups_per_core']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
