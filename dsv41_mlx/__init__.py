"""DeepSeek-V4.1 on Apple MLX, with the checkpoint's DSpark drafter for exact speculative decoding."""

import os
import warnings

# float32 matrix products in full float32, as DeepSeek's reference computes them (the head,
# the routers, the hyper-connection mixes, attention scores). MLX otherwise runs them at
# TF32 precision on CUDA and on Apple GPUs with neural accelerators (MLX_ENABLE_TF32
# defaults to 1). MLX reads the variable once, at its first float32 product, so it is set
# here, on import; a value already in the environment is kept.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

from .io.load import load  # noqa: E402 (after the environment above)
from .generate import generate, stream_generate  # noqa: E402
from .runtime.runner import Runner  # noqa: E402

# `python -m dsv41_mlx.generate` runs a module this package has already imported (for
# the `generate` function above); runpy's warning about that is harmless here.
warnings.filterwarnings("ignore", message="'dsv41_mlx.generate' found in sys.modules", category=RuntimeWarning)

__all__ = ["load", "generate", "stream_generate", "Runner"]
__version__ = "0.1.0"
