"""Loading a checkpoint: `load` (model and tokenizer) and `build_model` (the modules a config
describes, weights unread)."""

from __future__ import annotations

import os

from ..config import ModelArgs
from ..models.deepseek_v41 import Model
from ..models.dspark import DSparkStage
from ..tokenizer import cached_compressed_token_map, load_tokenizer
from .checkpoint import (CheckpointError, check_memory, check_tensors, declared_floats, load_weights, machine_memory,
                         resident_bytes, resolve_model_dir, shard_headers)
from .tiny import default_checkpoint


def build_model(args: ModelArgs) -> Model:
    """The target and, beside it in the checkpoint, the DSpark stages (`mtp`; the runtime's
    Drafter runs them). Nothing is allocated until the parameters are evaluated."""
    model = Model(args)
    if args.has_dspark:
        model.mtp = [DSparkStage(args, k) for k in range(args.num_nextn_predict_layers)]
    return model


def load(path_or_repo: str | os.PathLike | None = None, progress: bool = False) -> tuple[Model, object]:
    """(model, tokenizer) from a checkpoint directory or Hugging Face repo id.

    With no argument, the embedded default: a small checkpoint in the release format,
    generated once into the cache directory (io/tiny.py). Refuses, before reading any
    weights, a checkpoint whose weights exceed the machine's memory. progress: tqdm bars
    while loading.
    """
    model_dir = default_checkpoint() if path_or_repo is None else resolve_model_dir(path_or_repo)
    args = ModelArgs.from_file(model_dir / "config.json")
    headers = shard_headers(model_dir)
    where = check_tensors(args, headers)
    model = build_model(args)
    check_memory(resident_bytes(headers, where, declared_floats(model)), machine_memory(), model_dir)
    load_weights(model, model_dir, where, progress)
    tokenizer = load_tokenizer(model_dir)
    if model.hasher is not None:
        token_map, n = cached_compressed_token_map(tokenizer.path)
        if n != args.engram_compressed_vocab_size:
            raise CheckpointError(f"{tokenizer.path}: its compressed vocabulary has {n} ids but config.json "
                                  f"says engram_compressed_vocab_size = {args.engram_compressed_vocab_size}")
        model.hasher.token_map = token_map
    return model, tokenizer
