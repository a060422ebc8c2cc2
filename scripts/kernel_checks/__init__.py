"""The checks of scripts/check_kernels.py, one module per kernel family, on a shared harness
(harness.py): each GPU kernel against its pure-MLX spec. Beside them, what needs no GPU:
nvrtc.py compiles a CUDA twin as MLX wraps it, cases.py gives the GEMM kernels' launch
signatures (scripts/gemv_registers.py, scripts/sass_counts.py and the tests use both)."""

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")  # the specs' matmuls in true float32 (set before MLX runs one)
