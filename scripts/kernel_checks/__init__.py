"""The checks of scripts/check_kernels.py, one module per kernel family, on a shared harness
(harness.py): each GPU kernel against its pure-MLX spec."""

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")  # the specs' matmuls in true float32 (set before MLX runs one)
