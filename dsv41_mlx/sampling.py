"""Choosing tokens from logits.

Sampling is Gumbel-max with noise keyed by (seed, absolute position): the
token at position t is argmax(log p_t + G(seed, t)). The same (seed, t) always
gives the same noise, however the positions are batched into forwards, which
is what lets a drafted run reproduce an undrafted one token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = whole vocabulary
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be an integer in [0, 2**31), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p may drop tokens (else the log probabilities are logits / T less a constant)."""
        return bool(self.top_k) or self.top_p < 1.0


# Independent random streams per (seed, position). TARGET is the one plain decoding
# samples with (and the coupled drafter reuses on purpose); the others serve the
# rejection rule.
TARGET, DRAFT, ACCEPT, RESAMPLE = range(4)


def position_key(seed: int, position: int, stream: int = TARGET) -> mx.array:
    """The PRNG key of (seed, absolute position, stream)."""
    key = mx.random.key(seed * 2**32 + position)
    return key if stream == TARGET else mx.random.split(key, 3)[stream - 1]


def gumbel_noise(seed: int, positions: mx.array, vocab: int, stream: int = TARGET) -> mx.array:
    """Standard Gumbel noise [len(positions), vocab], a pure function of (seed, position, stream)."""
    rows = [mx.random.gumbel((vocab,), key=position_key(seed, int(p), stream)) for p in positions.tolist()]
    return mx.stack(rows)


def uniform_noise(seed: int, positions: mx.array, stream: int = ACCEPT) -> mx.array:
    """One U[0, 1) draw per position [len(positions)], a pure function of (seed, position, stream)."""
    return mx.stack([mx.random.uniform(key=position_key(seed, int(p), stream)) for p in positions.tolist()])


def filtered_log_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """log softmax(logits / T) over the tokens kept by top-k and the top-p nucleus (-inf elsewhere). [N, V] fp32."""
    logp = logits.astype(mx.float32) / params.temperature
    logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    if params.top_k and params.top_k < logp.shape[-1]:
        kth = mx.sort(logp, axis=-1)[:, -params.top_k][:, None]
        logp = mx.where(logp >= kth, logp, -mx.inf)
    if params.top_p < 1.0:
        order = mx.argsort(-logp, axis=-1)
        sorted_logp = mx.take_along_axis(logp, order, axis=-1)
        before = mx.cumsum(mx.exp(sorted_logp), axis=-1) - mx.exp(sorted_logp)  # mass ranked above each token
        keep_sorted = before < params.top_p
        keep = mx.put_along_axis(mx.zeros(logp.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
        logp = mx.where(keep, logp, -mx.inf)
    if params.filters:
        logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)  # renormalise over the kept tokens
    return logp


def sample(logits: mx.array, positions: mx.array, params: SamplingParams) -> mx.array:
    """Token ids [N] for logits [N, V] at absolute positions [N]."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    logp = filtered_log_probs(logits, params)
    return mx.argmax(logp + gumbel_noise(params.seed, positions, logits.shape[-1]), axis=-1)


def accept_or_resample(p: mx.array, q: mx.array, drafts: mx.array, u: mx.array,
                       g: mx.array) -> tuple[mx.array, mx.array]:
    """The speculative-sampling rule, row by row: keep draft x ~ q with probability
    min(1, p(x)/q(x)), otherwise draw from norm(max(0, p - q)).

    p, q [N, V] probabilities (target, draft); drafts [N]; u [N] uniforms; g [N, V]
    Gumbel noise for the residual draw. Returns (accepted [N] bool, token [N]):
    the draft where accepted, the residual sample where not. The token is then
    distributed exactly as p, whatever q is.
    """
    px = mx.take_along_axis(p, drafts[:, None], axis=-1)[:, 0]
    qx = mx.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]
    accepted = u * qx < px
    residual = mx.maximum(p - q, 0)
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p)  # p == q: never rejected anyway
    resampled = mx.argmax(mx.log(residual) + g, axis=-1)
    return accepted, mx.where(accepted, drafts, resampled.astype(drafts.dtype))
