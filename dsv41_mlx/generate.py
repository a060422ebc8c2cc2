"""Text generation: `generate_step` (token ids), `stream_generate` (text + stats), `generate`, and the CLI.

    python -m dsv41_mlx.generate --prompt "Hello"                    # embedded default
    python -m dsv41_mlx.generate --model deepseek-ai/DeepSeek-V4.1-Flash --prompt "Hello"
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Container, Iterator

import mlx.core as mx

from .cache import TRIM_SLACK, ModelCache
from .chat import EMPTY_PROMPT
from .models.attention import indexer_scoring_length
from .runtime.prefix_cache import PrefixCache
from .runtime.residency import wired
from .runtime.runner import Runner
from .sampling import SamplingParams, sample
from .speculative import VERIFY_MODES, DraftStats, SpeculativeDecoder, check_drafting_arguments
from .tokenizer import StreamingDetokenizer

DEFAULT_PREFILL_CHUNK = 256
PREFILL_ROUND = TRIM_SLACK  # a padded chunk's padding must be trimmable exactly


@dataclass
class GenerationResponse:
    text: str  # new text since the previous response
    token: int | None
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory_gb: float
    finish_reason: str | None = None  # "stop" (EOS), "length", or None while running
    draft_stats: DraftStats | None = None  # None when drafting is off
    cached_tokens: int = 0  # of the prompt's tokens, those resumed from the prompt cache (not prefilled)


def prefill(runner: Runner, prompt: list[int], cache: ModelCache, chunk: int = DEFAULT_PREFILL_CHUNK,
            keep_features: int = 0) -> tuple[mx.array, mx.array | None]:
    """Run the prompt through the model in chunks.

    A last, shorter chunk is padded to a multiple of PREFILL_ROUND rows (and the
    padding trimmed off again), so prompts of most lengths share a few chunk shapes:
    each new shape retraces the compiled pieces of every layer.

    Returns the last position's logits [vocab] and, when keep_features > 0, the
    DSpark features of the newest min(keep_features, len(prompt)) positions [n, 3*dim].
    """
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    vocab = runner.args.vocab_size
    outside = next((t for t in prompt if not 0 <= t < vocab), None)
    if outside is not None:  # an embedding gather past the table reads no error, only garbage
        raise ValueError(f"token id {outside} is outside the model's vocabulary of {vocab} ids "
                         "(a tokenizer that does not belong to this checkpoint?)")
    starts = range(0, len(prompt), chunk)
    ends = [min(start + chunk, len(prompt)) for start in starts]
    # each chunk's (ids, rows, rows_after). rows_after: the runner may leave out rows no later
    # read needs; the features then cover the chunk's last rows, always the newest
    # keep_features positions among them
    chunks = [(prompt[start:end], min(chunk, -(-(end - start) // PREFILL_ROUND) * PREFILL_ROUND), len(prompt) - end)
              for start, end in zip(starts, ends)]
    logits, kept = None, []
    first_kept = len(prompt) - keep_features
    for end, (logits, features) in zip(ends, runner.prefill_chunks(chunks, cache)):
        if keep_features and end > first_kept:
            kept.append(features[0, max(first_kept - (end - features.shape[1]), 0):])
        mx.eval(*(a for a in (logits, *kept) if a is not None), cache.state())
    return logits[0, -1], mx.concatenate(kept) if kept else None


def warm_up(runner: Runner, chunk: int = DEFAULT_PREFILL_CHUNK) -> float:
    """Run every shape a request's forwards take once, on scratch caches, so that no request
    pays for tracing the compiled pieces or for the GPU kernels' first use (on CUDA: seconds
    per kernel in every new process, minutes the first time on a machine while MLX builds
    them). Prefill: a last chunk of every padded row count, on an empty cache and on one
    holding a full chunk; then a few tokens greedy and sampled, plain and (with DSpark
    stages) drafted, which also measures the verify costs the schedule policy uses (a target
    forward of every verify size), and the drafter's ingest of every size (the GEMV kernels
    are built per bound on their rows); and a decode or verify forward of every size past
    the context where the indexers start scoring. Returns the seconds it took.

    What its made-up prompts showed of the drafter (whether drafting pays) and the plain steps'
    pace (kernel builds included) are forgotten again: the schedule learns them from requests."""
    tic = time.perf_counter()
    drafter = runner.drafter
    outlook = drafter.outlook if drafter is not None else None
    vocab = runner.args.vocab_size
    for rows in sorted(set(range(PREFILL_ROUND, chunk + 1, PREFILL_ROUND)) | {chunk}):
        for length in (rows, chunk + rows):
            prompt = [(7 * i + 3) % vocab for i in range(length)]
            mx.eval(prefill(runner, prompt, runner.make_cache(), chunk)[0])
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        for draft in (False, True) if drafter is not None else (False,):
            list(generate_step(runner, prompt[:PREFILL_ROUND], params, 3, chunk, make_decoder(runner, params, draft)))
    if drafter is not None:
        _warm_up_ingest(runner)
        drafter.outlook = outlook
    runner.plain_pace.clear()
    _warm_up_scoring(runner, chunk)
    # Start MLX's buffer cache afresh: on an H200 (MLX 0.32.4, CUDA) the allocator stopped
    # reusing buffers after these forwards until it was cleared (docs/results.md)
    mx.clear_cache()
    return time.perf_counter() - tic


def _warm_up_scoring(runner: Runner, chunk: int) -> None:
    """The forwards of a context past the indexers' free picks (indexer_scoring_length: the
    short warm-ups above pick every compressed position unscored): a prompt that long, then a
    decode or verify forward of every size on it (their GEMV kernels are built per bound on
    their rows)."""
    drafter = runner.drafter
    cache = runner.make_cache()
    prompt = [(7 * i + 3) % runner.args.vocab_size for i in range(indexer_scoring_length(runner.args))]
    prefill(runner, prompt, cache, chunk)
    for n in range(1, (drafter.block + 2 if drafter is not None else 2)):
        logits, features = runner.decode([3] * n, cache)
        mx.eval(logits, features, cache.state())
        cache.trim(n)


def _warm_up_ingest(runner: Runner) -> None:
    """Every ingest a drafting round can make (1 .. block + 1 committed positions), on a
    scratch draft cache."""
    drafter = runner.drafter
    cache = drafter.make_cache()
    for n in range(1, drafter.block + 2):
        drafter.ingest(cache, mx.zeros((n, runner.args.dspark_feature_dim), dtype=mx.bfloat16))
        mx.eval(cache.rings)


def prefill_cached(runner: Runner, prompt: list[int], prompt_cache: PrefixCache,
                   chunk: int = DEFAULT_PREFILL_CHUNK,
                   keep_features: int = 0) -> tuple[ModelCache, mx.array, mx.array | None]:
    """prefill through a prefix cache: the state of the prompt's longest kept prefix copied
    (PrefixCache.lookup), only the rest prefilled, stopping to keep the state where
    prompt_cache.store_points says (the prompt's end; before a last `<think>`). Returns the
    cache and prefill's (logits, features), the features those of the newest
    min(keep_features, len(prompt)) positions, the kept prefix's from its entry.

    On the CPU a row computes the same values whichever forward it shares, so the logits,
    features and state equal a prefill of the whole prompt (tests/test_prefix_cache.py); a GPU
    kernel may sum a row in another order at another row count, and round it otherwise."""
    entry = prompt_cache.lookup(prompt)
    if entry is None:
        cache, done, logits, features = runner.make_cache(), 0, None, None
    else:
        cache, done, logits, features = entry.resume(), len(entry.tokens), entry.logits, entry.features
    for end in prompt_cache.store_points(prompt, done):
        logits, new = prefill(runner, prompt[done:end], cache, chunk, keep_features)
        if keep_features:
            features = new if features is None else mx.concatenate([features, new])[-keep_features:]
        prompt_cache.store(cache, features, logits)
        done = end
    return cache, logits, features


def generate_step(runner: Runner, prompt: list[int], params: SamplingParams, max_tokens: int,
                  prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                  decoder: SpeculativeDecoder | None = None,
                  stop: Container[int] = (), prompt_cache: PrefixCache | None = None) -> Iterator[int]:
    """Yield up to max_tokens new token ids: plain decoding (one target forward per
    token), or speculative rounds through `decoder`. A token in `stop` (stream_generate
    passes the tokenizer's end-of-sequence ids) is yielded last: nothing is computed after it.

    Plain decoding starts the next token's forward before it yields a token, so whatever the
    caller does with it (detokenizing, printing, streaming it) overlaps the device's work.
    The caller must not evaluate the model's arrays (its cache, weights, outputs) while it
    holds a token: the runner's evaluator thread may still be starting that forward.

    prompt_cache: resume from the prompt's longest kept prefix and keep states for later
    prompts (prefill_cached); before the reply's last token is handed out, the state after
    the reply is kept too (the prompt and the reply but its last token, which no forward has
    fed), which a next chat turn's prompt continues. The same tokens with it as without."""
    if not prompt:
        raise ValueError(EMPTY_PROMPT)
    drafter = decoder.drafter if decoder is not None else runner.drafter if prompt_cache is not None else None
    keep = drafter.window if drafter is not None else 0  # (a kept state's features, for later drafted replies)
    if prompt_cache is None:
        cache = runner.make_cache()
        logits, features = prefill(runner, prompt, cache, prefill_chunk, keep)
    else:
        cache, logits, features = prefill_cached(runner, prompt, prompt_cache, prefill_chunk, keep)
    if max_tokens < 1:
        return
    # the newest features, for the state kept after the reply: the prompt's, then each forward's [1, n, F]
    kept = deque([features[None]], maxlen=keep) if prompt_cache is not None and keep else None
    if decoder is None:
        mx.eval(logits)  # (prefill's view of its last row, on this thread's stream: not the evaluator's to start)
        steps = plain_steps(runner, cache, params, max_tokens, stop, logits=logits, kept=kept)
    else:
        steps = drafted_steps(runner, decoder, cache, logits, features, max_tokens, stop, kept=kept)
    if prompt_cache is None:
        yield from steps
        return
    try:
        for n, token in enumerate(steps, start=1):
            if n == max_tokens or token in stop:  # the reply's last token
                next(steps, None)  # the steps end there (computing nothing), a begun forward abandoned
                _keep_reply_end(prompt_cache, cache, len(prompt) + n - 1, kept)
            yield token
    finally:
        steps.close()


def _keep_reply_end(prompt_cache: PrefixCache, cache: ModelCache, length: int, kept: deque | None) -> None:
    """Keep the state of the first `length` positions, where a reply ended: a round may have
    committed drafts past its stop token, trimmed off first (exactly: a round trims as much)."""
    extra = cache.offset - length
    cache.trim(extra)
    features = None
    if kept is not None:
        rows = mx.concatenate(list(kept), axis=1)[0]
        features = rows[: rows.shape[0] - extra][-kept.maxlen:]
    prompt_cache.store(cache, features)


def plain_steps(runner: Runner, cache: ModelCache, params: SamplingParams, n: int, stop: Container[int] = (),
                logits: mx.array | None = None, anchor: int | None = None,
                kept: list[mx.array] | None = None) -> Iterator[int]:
    """Yield up to n tokens by plain decoding, one target forward per token, from the last
    forward's `logits` [.., V] or from `anchor` (a token already yielded, at position
    cache.offset, not yet in the cache: its forward comes first). The last token yielded is
    not forwarded: the next step's forward, or the next round's anchor. kept: a list that
    gets each forward's features [1, 1, F]. Each token's seconds in here (not at the
    caller's) go to runner.plain_pace

    Each step begins the next forward before reading its token back (Runner.decode_ahead):
    the device runs the forward's first block straight after sampling the token, and on a
    GPU the host builds the rest of it meanwhile. The token is drawn on the forwards' stream,
    so the evaluator's thread starts its work straight after the forward's blocks. The
    token's forward is started (finish) before the token is yielded: the device waits for
    the host from the token's read to there (its engram rows), not for the caller too. A
    finished forward is not settled (that thread may still be starting its blocks) until
    the next decode_ahead, or Runner.settle, before this loop waits for anything."""
    ahead = None
    tic = time.perf_counter()
    try:
        if anchor is not None:
            ahead = runner.decode_ahead(mx.array([anchor], dtype=mx.int32), cache)
            logits, features = ahead.finish(anchor, settle=False)
            ahead = None
            if kept is not None:
                kept.append(features)
        for i in range(n):
            position = cache.offset  # the new token's absolute position
            drawn = draw_token(runner, logits, position, params)
            ahead = runner.decode_ahead(drawn, cache, on_forward_stream=True) if i + 1 < n else None
            if ahead is None:
                runner.settle()
            token = drawn.item()
            if ahead is not None and token not in stop:
                logits, features = ahead.finish(token, settle=False)  # [1, 1, V], [1, 1, F]
                ahead = None
                if kept is not None:
                    kept.append(features)
            runner.plain_pace.append(time.perf_counter() - tic)
            yield token
            tic = time.perf_counter()
            if token in stop:
                return
    finally:
        if ahead is not None:  # a stop token, or the caller stopped early: the begun forward abandoned
            ahead.cancel()
        runner.settle()


def drafted_steps(runner: Runner, decoder: SpeculativeDecoder, cache: ModelCache, last_logits: mx.array,
                  features: mx.array, max_tokens: int, stop: Container[int] = (),
                  kept: deque | list | None = None) -> Iterator[int]:
    """Yield up to max_tokens tokens after a prefilled prompt by speculative rounds, and by
    plain steps where the decoder finds drafting does not pay (SpeculativeDecoder.plain_tokens),
    the drafter's rings caught up on them before the next round. A token in `stop` is the last.

    last_logits [V]: the prompt's last row; features [n, 3*dim]: the prompt's newest n rows
    (n >= min(window, prompt length)), ingested first. kept: gets the features [1, n, F] of
    the positions each round or plain stretch commits (a round's, drafts past a stop token
    included)."""
    draft_cache = decoder.begin(cache, features)
    anchor = sample(last_logits[None], mx.array([cache.offset]), decoder.params).item()
    yield anchor
    produced = 1
    if anchor in stop:
        return
    left = 0  # the plain tokens asked for and not yet decoded: the decoder's again if the reply ends first
    try:
        while produced < max_tokens:
            plain = left = decoder.plain_tokens(max_tokens - produced)
            if plain:
                stretch = []
                steps = plain_steps(runner, cache, decoder.params, plain, stop, anchor=anchor, kept=stretch)
            else:
                steps = decoder.round(cache, draft_cache, anchor, max_tokens - produced, stop)
                if kept is not None:
                    kept.append(decoder.committed_features)
            for token in steps:
                decoder.stats.plain_steps += bool(plain)  # (counted before the caller may stop reading)
                left -= bool(plain)
                yield token
                produced += 1
                if token in stop:
                    break
            if plain and kept is not None:
                kept.extend(stretch)
            if token in stop:
                if plain:
                    steps.close()  # its begun forward abandoned now, before the caller reads the cache
                return
            if plain:
                decoder.after_plain(mx.concatenate(stretch, axis=1)[0])
            anchor = token
    finally:
        decoder.cancel_ahead()  # a round begun ahead that no caller will take up
        decoder.plain_unused(left)


def draw_token(runner: Runner, logits: mx.array, position: int, params: SamplingParams) -> mx.array:
    """generate_step's plain token at that absolute position from a forward's last logits [V]
    (any shape of V values): [1] on the device, drawn on the forwards' stream, as
    Runner.decode_ahead(..., on_forward_stream=True) takes it."""
    with runner.forward_stream():
        return sample(logits.reshape(1, -1), mx.array([position]), params)


def make_decoder(runner: Runner, params: SamplingParams, draft: bool | None = None, verify: str | None = None,
                 confidence: str | None = None) -> SpeculativeDecoder | None:
    """The speculative decoder these arguments ask for, or None for plain decoding.

    draft None = on when the checkpoint has DSpark stages. verify None = greedy
    at temperature 0, coupled above. confidence None = schedule.
    """
    drafter = runner.drafter
    if draft is None:
        draft = drafter is not None
    check_drafting_arguments(bool(draft), verify, confidence)
    if not draft:
        return None
    if drafter is None:
        raise ValueError("drafting needs DSpark stages, and this checkpoint has none")
    if drafter.head == "fp8":
        drafter.fp8_head  # built (and logged) before the first token, not in the middle of a reply
    return SpeculativeDecoder(runner, drafter, params, verify, confidence or "schedule")


def stream_generate(model, tokenizer, prompt: str | list[int], max_tokens: int = 256,
                    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                    prefill_chunk: int = DEFAULT_PREFILL_CHUNK, draft: bool | None = None,
                    verify: str | None = None, confidence: str | None = None,
                    wire: bool = True, runner: Runner | None = None,
                    prompt_cache: PrefixCache | None = None) -> Iterator[GenerationResponse]:
    """Generate from a prompt (text, or token ids), yielding text pieces with running stats.

    draft/verify/confidence: see `make_decoder` and speculative.py. Replies are
    the same with drafting on or off (greedy and coupled verification).
    wire: keep the drafter (and the target if it fits) in wired memory while
    generating (runtime/residency.py; Metal only). runner: the model's Runner to schedule
    the forwards with, where the caller keeps one across generations (the server does);
    default: one made for this generation, with the device's options (runtime/options.py).
    The same replies either way. prompt_cache: the model's PrefixCache, kept across
    generations: the prompt's longest kept prefix is not prefilled again (the responses'
    cached_tokens), and states are kept for later prompts (generate_step). The same replies
    with it as without.
    """
    if not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
    params = SamplingParams(temperature, top_p, top_k, seed)
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    context = model.args.max_position_embeddings
    if context and len(ids) >= context:
        raise ValueError(f"the prompt is {len(ids)} tokens; this model's context is {context} tokens")
    if context:  # the reply stops where the context ends (finish reason "length")
        max_tokens = min(max_tokens, context - len(ids))
    with contextlib.nullcontext(runner) if runner is not None else Runner(model) as runner:
        decoder = make_decoder(runner, params, draft, verify, confidence)
        stats = decoder.stats if decoder is not None else None
        with wired(model, decoder.drafter if decoder is not None else None, enabled=wire):
            yield from _responses(runner, tokenizer, ids, params, max_tokens, prefill_chunk, decoder, stats,
                                  prompt_cache)


def _responses(runner, tokenizer, ids, params, max_tokens, prefill_chunk, decoder, stats, prompt_cache):
    detok = StreamingDetokenizer(tokenizer)
    mx.reset_peak_memory()
    cached = prompt_cache.cached_length(ids) if prompt_cache is not None else 0  # what generate_step resumes
    tic = time.perf_counter()
    prompt_tps = 0.0
    steps = generate_step(runner, ids, params, max_tokens, prefill_chunk, decoder, tokenizer.eos_token_ids,
                          prompt_cache)
    for n, token in enumerate(steps, start=1):
        if n == 1:
            prompt_tps = (len(ids) - cached) / (time.perf_counter() - tic)  # the tokens prefilled
            tic = time.perf_counter()
        done = token in tokenizer.eos_token_ids
        text = "" if done else detok.add_token(token)
        finish = "stop" if done else "length" if n == max_tokens else None
        if finish:
            text += detok.finalize()
        elapsed = time.perf_counter() - tic
        yield GenerationResponse(text, token, len(ids), prompt_tps, n, n / elapsed if elapsed > 0 else 0.0,
                                 mx.get_peak_memory() / 1e9, finish, stats, cached)
        if done:
            return


def generate(model, tokenizer, prompt: str | list[int], verbose: bool = False, **kwargs) -> str:
    """The whole reply as one string; with verbose, stream it to stdout and print one stats line."""
    text, last = [], None
    for last in stream_generate(model, tokenizer, prompt, **kwargs):
        text.append(last.text)
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print()
        print(stats_line(last), file=sys.stderr)
        if last.draft_stats is not None:
            print(last.draft_stats.summary(), file=sys.stderr)
    return "".join(text)


def stats_line(r: GenerationResponse) -> str:
    cached = f" ({r.cached_tokens} cached)" if r.cached_tokens else ""
    return (f"prompt: {r.prompt_tokens} tokens{cached}, {r.prompt_tps:.1f} tok/s | "
            f"generation: {r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s | "
            f"peak memory: {r.peak_memory_gb:.3f} GB")


DESCRIPTION = """\
Generate a reply to a prompt with DeepSeek-V4.1 on Apple MLX; the reply streams
to stdout, progress and the stats line (speed, peak memory) go to stderr.
Without --model it runs a small embedded checkpoint (random weights, built on
first use): every option works in seconds, but the replies are gibberish."""

EXAMPLES = """\
examples:
  python -m dsv41_mlx.generate --prompt "Hello"
  python -m dsv41_mlx.generate --model deepseek-ai/DeepSeek-V4.1-Flash \\
      --prompt "Write a haiku about the sea" --temp 0.7 --max-tokens 100"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help; an option whose default is None or off says in words what it does."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _finite_float(text: str) -> float:
    import math

    value = float(text)  # argparse reports a ValueError as "invalid float value"
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


_finite_float.__name__ = "float"  # argparse names the type in "invalid float value: 'x'"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dsv41_mlx.generate", description=DESCRIPTION,
                                     epilog=EXAMPLES, formatter_class=_HelpFormatter)
    parser.add_argument("--model", help="checkpoint directory or Hugging Face repo id (owner/name) "
                                        "(default: the embedded tiny model)")
    parser.add_argument("--prompt", default="Hello", help="the prompt text")
    parser.add_argument("--max-tokens", type=int, default=64, help="the most tokens to generate (>= 1)")
    parser.add_argument("--temp", type=_finite_float, default=0.0, help="sampling temperature (>= 0); 0 = greedy")
    parser.add_argument("--top-p", type=_finite_float, default=1.0,
                        help="nucleus sampling: keep the most likely tokens up to this mass, in (0, 1]")
    parser.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens; 0 = all")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed, 0 to 2**31 - 1")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                        help="prompt tokens per forward while prefilling (>= 1)")
    parser.add_argument("--draft", action=argparse.BooleanOptionalAction, default=None,
                        help="speculative decoding with the checkpoint's DSpark drafter "
                             "(default: on when the checkpoint has one)")
    parser.add_argument("--verify", choices=VERIFY_MODES,
                        help="how drafts are verified (default: greedy at --temp 0, else coupled)")
    parser.add_argument("--confidence", metavar="{off,threshold:X,schedule}",
                        help="how many drafts to verify per round (default: schedule)")
    parser.add_argument("--wire", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the drafter (and the target if it fits) in wired memory (Metal)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars or log lines: only the reply and the stats lines")
    parser.add_argument("--no-stats", action="store_true",
                        help="no stats lines (speed, peak memory, drafting) after the reply")
    from .runtime.pipeline import add_split_argument

    add_split_argument(parser)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every argument checked before any model loads: a bad one exits (2) through parser.error,
    with a one-line message naming it. The rules are the library's own (SamplingParams,
    resolve_verify, ConfidencePolicy, check_drafting_arguments, local_model_dir); what needs
    the model (the prompt against its context, drafting without a drafter) is checked once it is
    loaded."""
    from .io.checkpoint import CheckpointError, local_model_dir
    from .speculative import ConfidencePolicy, check_drafting_arguments, resolve_verify

    def check(flag, fn, *fn_args, **fn_kwargs):
        try:
            return fn(*fn_args, **fn_kwargs)
        except ValueError as e:
            parser.error(f"argument {flag}: {e}")

    for flag, field, value in (("--temp", "temperature", args.temp), ("--top-p", "top_p", args.top_p),
                               ("--top-k", "top_k", args.top_k), ("--seed", "seed", args.seed)):
        check(flag, SamplingParams, **{field: value})  # one at a time, to name the one that is wrong
    params = SamplingParams(args.temp, args.top_p, args.top_k, args.seed)
    if args.max_tokens < 1:
        parser.error(f"argument --max-tokens: must be >= 1, got {args.max_tokens}")
    if args.prefill_chunk < 1:
        parser.error(f"argument --prefill-chunk: must be >= 1, got {args.prefill_chunk}")
    if not args.prompt.strip():
        parser.error(EMPTY_PROMPT)
    if args.verify is not None:
        check("--verify", resolve_verify, args.verify, params)
    if args.confidence is not None:
        check("--confidence", ConfidencePolicy.parse, args.confidence)
    check("--verify" if args.verify is not None else "--confidence", check_drafting_arguments, args.draft,
          args.verify, args.confidence)
    if args.model is not None:
        try:
            local_model_dir(args.model)  # a local path checked; a repo id left to the loader
        except CheckpointError as e:
            parser.error(f"argument --model: {e}")


def main(argv: list[str] | None = None) -> int:
    from .config import ConfigError
    from .io.checkpoint import CheckpointError
    from .io.load import load_launched
    from .runtime.pipeline import Link, launched_group, launched_runner, serve

    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    group = launched_group(parser, args.pipeline_split)  # under mlx.launch: one rank of a pipeline
    quiet = args.quiet or group.rank() > 0  # the other ranks print nothing but errors
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(message)s")
    try:
        model, tokenizer = load_launched(args.model, group, args.pipeline_split, progress=not quiet)
        if group.rank() > 0:
            serve(model, Link(group))  # rank 0's commands, until it is done
            return 0
        with launched_runner(model, group) as runner:
            drafting = args.draft if args.draft is not None else runner.drafter is not None
            if drafting and runner.drafter is not None and runner.drafter.head == "fp8":
                runner.drafter.build_fp8_head(progress=not args.quiet)
            last = None
            for last in stream_generate(model, tokenizer, args.prompt, max_tokens=args.max_tokens,
                                        temperature=args.temp, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                        prefill_chunk=args.prefill_chunk, draft=args.draft, verify=args.verify,
                                        confidence=args.confidence, wire=args.wire, runner=runner):
                print(last.text, end="", flush=True)
            print()
    except (CheckpointError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if last is not None and not args.no_stats:
        print(stats_line(last), file=sys.stderr)
        if last.draft_stats is not None:
            print(last.draft_stats.summary(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
