"""DeepSeek-V4.1 on Apple MLX, with the checkpoint's DSpark drafter for exact speculative decoding."""

from .checkpoint import load

__all__ = ["load", "generate", "stream_generate"]
__version__ = "0.1.0"


def __getattr__(name):
    # imported on first use, so `python -m dsv41_mlx.generate` does not import the module twice
    if name in ("generate", "stream_generate"):
        import importlib

        return getattr(importlib.import_module(".generate", __name__), name)
    raise AttributeError(f"module 'dsv41_mlx' has no attribute {name!r}")
