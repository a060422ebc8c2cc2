"""DeepSeek-V4.1 on Apple MLX, with the checkpoint's DSpark drafter for exact speculative decoding."""

import warnings

from .checkpoint import load
from .generate import generate, stream_generate

# `python -m dsv41_mlx.generate` runs a module this package has already imported (for
# the `generate` function above); runpy's warning about that is harmless here.
warnings.filterwarnings("ignore", message="'dsv41_mlx.generate' found in sys.modules", category=RuntimeWarning)

__all__ = ["load", "generate", "stream_generate"]
__version__ = "0.1.0"
