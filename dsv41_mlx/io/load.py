"""Loading a checkpoint: `load` (model and tokenizer) and `build_model` (the modules a config
describes, weights unread); `load_stage`, one rank's part of it in a pipeline
(runtime/pipeline.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import mlx.core as mx

from ..config import ModelArgs
from ..models.deepseek_v41 import Model
from ..models.dspark import DSparkStage
from ..runtime.pipeline import StageModel, agree, balance, check_split, cut_points, parse_split, split_digest
from ..tokenizer import cached_compressed_token_map, load_tokenizer
from .checkpoint import (CheckpointError, check_memory, check_tensors, checkpoint_digest, declared_floats,
                         load_weights, machine_memory, resident_bytes, resolve_model_dir, shard_headers, size_text)
from .tiny import default_checkpoint

log = logging.getLogger("dsv41_mlx")


def build_model(args: ModelArgs) -> Model:
    """The target and, beside it in the checkpoint, the DSpark stages (`mtp`; the runtime's
    Drafter runs them). Nothing is allocated until the parameters are evaluated."""
    return _with_stages(Model(args))


def build_stage(args: ModelArgs, ranges: list[range], rank: int) -> StageModel:
    """build_model's part for rank `rank` of a pipeline split into `ranges`: the DSpark stages
    on rank 0, where generation is driven."""
    model = StageModel(args, ranges, rank)
    return _with_stages(model) if rank == 0 else model


def _with_stages(model: Model) -> Model:
    args = model.args
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
    return model, _tokenizer_for(model, model_dir)


def _tokenizer_for(model: Model, model_dir: Path):
    """The checkpoint's tokenizer, its compressed token map given to the model's engram hasher."""
    args = model.args
    tokenizer = load_tokenizer(model_dir)
    if model.hasher is not None:
        token_map, n = cached_compressed_token_map(tokenizer.path)
        if n != args.engram_compressed_vocab_size:
            raise CheckpointError(f"{tokenizer.path}: its compressed vocabulary has {n} ids but config.json "
                                  f"says engram_compressed_vocab_size = {args.engram_compressed_vocab_size}")
        model.hasher.token_map = token_map
    return tokenizer


def balanced_split(args: ModelArgs, headers: dict, where: dict[str, Path], declared: dict,
                   ranks: int) -> list[range]:
    """pipeline.balance of the checkpoint's layers over `ranks` ranks, by their resident bytes
    (resident_bytes: engram tables left out), rank 0 counting every tensor outside the layers."""
    per_layer: list[dict[str, Path]] = [{} for _ in range(args.num_hidden_layers)]
    rest: dict[str, Path] = {}
    for name, path in where.items():
        top, _, inside = name.partition(".")
        (per_layer[int(inside.partition(".")[0])] if top == "layers" else rest)[name] = path
    return balance([resident_bytes(headers, w, declared) for w in per_layer], resident_bytes(headers, rest, declared),
                   ranks, cut_points(args))


def load_launched(path_or_repo: str | os.PathLike | None, group: mx.distributed.Group, split: str | None = None,
                  progress: bool = False) -> tuple[Model, object]:
    """load, or where mlx.launch started several ranks (group), load_stage: this rank's part."""
    if group.size() > 1:
        return load_stage(path_or_repo, group, split, progress)
    return load(path_or_repo, progress)


def load_stage(path_or_repo: str | os.PathLike | None, group: mx.distributed.Group, split: str | None = None,
               progress: bool = False) -> tuple[StageModel, object]:
    """(this rank's StageModel, tokenizer) of a pipeline over `group`: the checkpoint's layers
    split as `split` says ('0:20,20:40', one range per rank), by default so that the ranks'
    resident bytes are balanced (rank 0 also holds the embedding, head, norm and DSpark stages),
    and only this rank's tensors read (its engram layers' tables memory-mapped). Before any
    weight is read, every rank checks that the others have the same checkpoint (config.json
    and safetensors index) and split: PipelineError otherwise. Rank 0 logs each rank's
    layers and resident bytes."""
    rank, ranks = group.rank(), group.size()
    if path_or_repo is None:  # the embedded default built once, by rank 0, where ranks share a machine
        if rank == 0:
            default_checkpoint()
        mx.eval(mx.distributed.all_sum(mx.array(0), group=group, stream=mx.cpu))
        model_dir = default_checkpoint()
    else:
        model_dir = resolve_model_dir(path_or_repo)
    agree(group, checkpoint_digest(model_dir), "checkpoint (config.json and safetensors index)")
    args = ModelArgs.from_file(model_dir / "config.json")
    headers = shard_headers(model_dir)
    where = check_tensors(args, headers)
    declared = declared_floats(build_model(args))  # (nothing allocated)
    ranges = parse_split(split) if split is not None else balanced_split(args, headers, where, declared, ranks)
    check_split(args, ranges, ranks)
    agree(group, split_digest(ranges), "split of the layers")
    model = build_stage(args, ranges, rank)
    mine = {name: path for name, path in where.items() if model.holds(name)}
    resident = resident_bytes(headers, mine, declared)
    check_memory(resident, machine_memory(), model_dir)
    load_weights(model, model_dir, mine, progress)
    every = mx.distributed.all_gather(mx.array([resident], dtype=mx.int64), group=group, stream=mx.cpu).tolist()
    if rank == 0:
        for r, (held, nbytes) in enumerate(zip(ranges, every)):
            also = (" + embedding, norm, head" + (", DSpark stages" if args.has_dspark else "")) if r == 0 else ""
            log.info("pipeline rank %d: layers %d..%d%s, %s resident (engram tables memory-mapped)",
                     r, held.start, held.stop - 1, also, size_text(nbytes))
    return model, _tokenizer_for(model, model_dir)
