"""Check the GPU kernels (CUDA twins on an NVIDIA GPU, Metal on a Mac) against the pure-MLX spec.

    python scripts/check_kernels.py            # exits 1 on any mismatch
    python scripts/check_kernels.py moe_gate   # only the checks whose names start so
    python scripts/check_kernels.py --rows=1,6 # at these row counts only (fewer kernel builds)

Each kernel family's checks are a module of scripts/kernel_checks/, whose docstring says what
they compare and within what; scripts/kernel_checks/harness.py holds what they share.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (kernel_checks first: it sets MLX_ENABLE_TF32 before MLX is imported)
from scripts.kernel_checks import (drafter, epilogues, fake_quant, fp4_experts, fp8_gemv, harness, hc,  # noqa: E402
                                   head_logits, mlx_gemms, moe_gate, rms_norm, sparse_attention)
from dsv41_mlx.kernels import backend  # noqa: E402

# (name, check, seed), in the order they run; check(impl, seed=seed) -> problems
CHECKS = [("ring_write", drafter.check_ring_write, 3), ("markov_drafts", drafter.check_markov_drafts, 71),
          ("act_quant", fake_quant.check_act_quant, 9),
          ("fp4_quant", fake_quant.check_fp4_quant, 29), ("fp8_gemv", fp8_gemv.check_fp8_gemv, 31),
          ("fp8_gemv_pair", fp8_gemv.check_fp8_gemv_pair, 59), ("fp4_experts", fp4_experts.check_fp4_experts, 37),
          ("gemv_epilogues", epilogues.check_gemv_epilogues, 47), ("head_logits", head_logits.check_head_logits, 53),
          ("hc_split", hc.check_hc_split, 5), ("rms_norm", rms_norm.check_rms_norm, 23),
          ("rms_norm_rope", rms_norm.check_rms_norm_rope, 43), ("rms_norm_pair", rms_norm.check_rms_norm_pair, 61),
          ("hc_input", hc.check_hc_input, 17), ("hc_post_input", hc.check_hc_post_input, 41),
          ("fp8_into_stream", hc.check_fp8_into_stream, 67),
          ("sparse_attention", sparse_attention.check_sparse_attention, 19), ("moe_gate", moe_gate.check_moe_gate, 13)]
# MLX's own GEMMs fed bf16 (quant.gemm_input_dtype feeds them so on CUDA): check(seed=seed) -> (problems, notes)
GEMMS_BF16 = ("quantised GEMMs, bf16-fed vs fp32-fed", mlx_gemms.check_gemms_bf16, 11)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="*", metavar="NAME", help="only the checks whose names start so")
    parser.add_argument("--rows", type=lambda text: tuple(int(r) for r in text.split(",")),
                        default=",".join(map(str, harness.CHECK_ROWS)),
                        help="the row counts most checks run, e.g. 1,6: a decode step's and a verify step's, each "
                             "kernel built fewer times (NVRTC's minutes) (default: %(default)s)")
    args = parser.parse_args()
    impl = backend()
    if impl == "mlx":
        print("no GPU backend here (Metal or CUDA): nothing to check")
        return 1
    harness.CHECK_ROWS = args.rows
    print(f"checking the {impl} kernels against the pure-MLX spec at {', '.join(map(str, args.rows))} rows")

    def wanted(name):
        return not args.only or any(name.startswith(prefix) for prefix in args.only)

    failures = 0
    for n, k in [(129280, 5120), (8192 + 96, 128)] if wanted("fp8_rows") else []:
        for rows in args.rows:
            problems = drafter.check_fp8_rows(n, k, rows, impl, seed=rows * 7 + k)
            failures += bool(problems)
            print(f"fp8_rows N={n} K={k} rows={rows}: {'ok' if not problems else '; '.join(problems[:3])}")
    checks = CHECKS[:3] + ([GEMMS_BF16] if impl == "cuda" else []) + CHECKS[3:]
    for name, check, seed in [c for c in checks if wanted(c[0])]:
        problems, notes = check(seed=seed) if check is mlx_gemms.check_gemms_bf16 else (check(impl, seed=seed), [])
        failures += bool(problems)
        print(f"{name}: {'ok' if not problems else '; '.join(problems[:5])}")
        for note in notes:
            print(f"  {note}")
    print("ALL OK" if not failures else f"{failures} FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
