"""DeepSeek-V4.1 on Apple MLX, with the checkpoint's DSpark drafter for exact speculative decoding."""

from .checkpoint import load
from .generate import generate, stream_generate

__all__ = ["load", "generate", "stream_generate"]
__version__ = "0.1.0"
