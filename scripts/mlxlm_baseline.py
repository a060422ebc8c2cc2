"""mlx-lm's own DeepSeek-V4.1 port as the baseline of `scripts/bench.py e2e` and `context`.

    python scripts/mlxlm_baseline.py CHECKPOINT [--prompts 2] [--prompt-tokens 256] [--tokens 64]
    python scripts/mlxlm_baseline.py CHECKPOINT --prompt-ids PROMPT.json [--tokens 64] [--json RUN.json]

(the second form is how `bench.py context` runs it, a process per context).

Builds mlx-lm 0.32.x's `mlx_lm.models.deepseek_v41` (no engram, no DSpark)
from one of our release-format checkpoints with mlx-lm's own loader, and times
a plain greedy decode on mlx-lm's own cache.

Engram. mlx-lm has none, and its ModelArgs refuses a config that lists
engram layers. `load_mlxlm` hands `mlx_lm.utils.load_model` a copy of
`text_config` with `engram_layer_ids: []` (the other `engram_*` keys are not
mlx-lm fields and it ignores them). mlx-lm's `sanitize` itself drops every
`layers.N.engram.*` tensor (table, wkv, q/k weights) and the DSpark stages
`mtp.*`, and the load is strict, so no tensor is left unplaced and no
parameter unfilled. The baseline is therefore the model without its engram
lookups: on a checkpoint with engram layers its tokens are not ours, and a
token costs it the engram gathers less (row reads, small beside the weights).

Weights stay as the release stores them; nothing is dequantised or
requantised. To mlx-lm a `quantization_config` of fp8 with ue8m0 scales over
32x32 blocks is MLX's `mxfp8`: its sanitize reinterprets the E4M3 codes as
packed uint32 words and repeats each 32x32 tile's E8M0 scale over the tile's
32 rows (one scale per 32 inputs of a row); the I8 FP4 experts (E2M1 pairs,
E8M0 per 32 inputs) are stacked per layer and taken as `mxfp4`. The loader
then swaps every layer that has scales for QuantizedLinear or
QuantizedSwitchLinear, the mode read off the bit width: "mxfp8 dense / mxfp4
experts". BF16 and F32 tensors (embedding, head, norms, router, compressor,
index keys, hyper-connections) stay in their stored dtype.

The arithmetic is not ours: mlx-lm feeds bf16 activations straight into the
quantised matmuls where the reference (and we) first round them to FP8, and
weights the routed experts after their down projection rather than before.
Fed the same input, each of its decoder layers matches ours to 5-12% of what
the layer adds (small flash-shaped checkpoint, CPU); over a stack of
random-weight layers that grows, so only a loose closeness of logits is
expected (tests/test_mlxlm_baseline.py).

Timing: the prompt as mlx-lm's `generate_step` feeds it (all but the last
token in chunks of `PREFILL_STEP`, the cache evaluated after each, then the
last token alone, whose argmax is the first new token); then, as our engine's
plain decode, one forward per token, argmax, and `.item()` (a
synchronisation) each step. mlx-lm's own `generate_step` overlaps the next
step's graph building with the running step (`mx.async_eval`); neither this
loop nor ours does. A warm-up generation on the first prompt comes first.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

SUPPORTED_SERIES = "0.32."
UNAVAILABLE_STATUS = 3  # main's exit status when mlx-lm is missing or of another version
PREFILL_STEP = 2048  # mlx-lm generate_step's default prefill_step_size
WARMUP_TOKENS = 4


class MlxLmUnavailable(RuntimeError):
    """mlx-lm is missing, of another version or cannot be imported. The message is one
    line that starts with "mlx-lm:", for a benchmark to print before it goes on."""


def require_mlxlm():
    """`mlx_lm.utils` of an installed mlx-lm 0.32.x; raises MlxLmUnavailable otherwise."""
    try:
        version = metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:
        raise MlxLmUnavailable("mlx-lm: not installed (pip install 'mlx-lm==0.32.2')") from None
    if not version.startswith(SUPPORTED_SERIES):
        raise MlxLmUnavailable(f"mlx-lm: version {version} is installed; the baseline needs 0.32.x")
    try:
        from mlx_lm import utils
        importlib.import_module("mlx_lm.models.deepseek_v41")  # the architecture must be there
    except ImportError as e:  # mlx_lm imports transformers at the top of the package
        raise MlxLmUnavailable(f"mlx-lm: {version} cannot be imported ({e})") from None
    return utils


def load_mlxlm(path: str | Path):
    """mlx-lm's deepseek_v41 Model of the release checkpoint at `path`, engram layers removed,
    weights read and evaluated. Raises MlxLmUnavailable without mlx-lm 0.32.x."""
    utils = require_mlxlm()
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    if "text_config" in config:
        no_engram = {"text_config": {**config["text_config"], "engram_layer_ids": []}}
    else:
        no_engram = {"engram_layer_ids": []}
    model, _ = utils.load_model(path, strict=True, model_config=no_engram)
    return model


def greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    """`new_tokens` greedy tokens after `prompt` on a fresh mlx-lm cache, with the seconds
    of the prefill (through the first token) and of the decode forwards after it."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    cache = model.make_cache()
    ids = mx.array(prompt, dtype=mx.int32)[None]
    mx.synchronize()
    tic = time.perf_counter()
    # as mlx-lm's generate_step: all but the last token in chunks, then the last one alone
    for start in range(0, len(prompt) - 1, PREFILL_STEP):
        model(ids[:, start: min(start + PREFILL_STEP, len(prompt) - 1)], cache=cache)
        mx.eval([layer.state for layer in cache])
    token = mx.argmax(model(ids[:, -1:], cache=cache)[:, -1], axis=-1)  # [1]
    tokens = [token.item()]
    prefill_s = time.perf_counter() - tic
    tic = time.perf_counter()
    for _ in range(new_tokens - 1):
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1], axis=-1)
        tokens.append(token.item())
    return tokens, prefill_s, time.perf_counter() - tic


@dataclass
class BaselineRun:
    prefill_tok_s: float  # prompt tokens over the seconds to the first token
    decode_tok_s: float  # tokens after the first over their seconds
    peak_memory_gb: float  # MLX's peak while generating, weights included
    weights_gb: float
    load_s: float
    replies: list[list[int]]  # the greedy tokens, one list per prompt


def bench_mlxlm(path: str | Path, prompt_ids: list[int] | list[list[int]], new_tokens: int) -> BaselineRun:
    """Prefill and decode speed of mlx-lm on the checkpoint at `path` (engram removed).

    prompt_ids: one prompt's token ids, or a list of prompts; rates add up the
    tokens and seconds of all prompts. Raises MlxLmUnavailable without mlx-lm 0.32.x.
    """
    prompts = [prompt_ids] if isinstance(prompt_ids[0], int) else prompt_ids
    tic = time.perf_counter()
    model = load_mlxlm(path)
    load_s = time.perf_counter() - tic
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    greedy(model, prompts[0], min(new_tokens, WARMUP_TOKENS))
    mx.reset_peak_memory()
    replies, prefill_s, decode_s = [], 0.0, 0.0
    for prompt in prompts:
        tokens, p_s, d_s = greedy(model, prompt, new_tokens)
        replies.append(tokens)
        prefill_s += p_s
        decode_s += d_s
    peak = mx.get_peak_memory()
    del model
    mx.clear_cache()  # hand the memory back before the engine under test loads
    decoded = sum(len(r) - 1 for r in replies)
    return BaselineRun(prefill_tok_s=sum(map(len, prompts)) / prefill_s,
                       decode_tok_s=decoded / decode_s if decoded else float("nan"),
                       peak_memory_gb=peak / 1e9, weights_gb=weights / 1e9, load_s=load_s, replies=replies)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=256, help="random token ids per prompt")
    parser.add_argument("--prompt-ids", type=Path, metavar="FILE",
                        help="one prompt, a JSON list of token ids, in place of the random ones")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the run (BaselineRun's fields) here")
    args = parser.parse_args()
    if args.prompt_ids:
        prompts = [json.loads(args.prompt_ids.read_text())]
    else:
        config = json.loads((args.checkpoint / "config.json").read_text())
        vocab = config.get("text_config", config)["vocab_size"]
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, vocab, size=args.prompt_tokens).tolist() for _ in range(args.prompts)]
    try:
        run = bench_mlxlm(args.checkpoint, prompts, args.tokens)
    except MlxLmUnavailable as e:
        print(e)
        return UNAVAILABLE_STATUS
    if args.json:
        args.json.write_text(json.dumps(asdict(run)))
    print(f"mlx-lm {metadata.version('mlx-lm')} on {args.checkpoint} (engram removed): load {run.load_s:.1f} s, "
          f"prefill {run.prefill_tok_s:.1f} tok/s, decode {run.decode_tok_s:.2f} tok/s, weights "
          f"{run.weights_gb:.2f} GB, peak {run.peak_memory_gb:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
