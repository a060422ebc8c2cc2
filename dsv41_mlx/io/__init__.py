"""Checkpoints: the release's safetensors format, the embedded default, loading."""
