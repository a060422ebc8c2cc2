"""What the benchmarks share: the run's environment, timing, the copy bandwidth and the floors
computed from it, release-shaped models and weights, operation counts, the kernels' layout
choices swapped in for a measurement, and stand-in drafters (the oracle) for the benchmarks
and the tests.

Speed is measured against baselines measured in the same run, and as fractions of the
memory-bandwidth floor: the bytes that must move over the copy bandwidth measured in the
same run, counting read + write bytes.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import hashlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from dsv41_mlx.kernels import backend, device_backend, tuning

ROOT = Path(__file__).resolve().parent.parent.parent


def mlx_launch(ranks: int, command: list[str]) -> list[str]:
    """The command line that runs `command` as `ranks` local processes under `mlx.launch`'s ring
    backend (over loopback), on a free port (rank r listens on port + r)."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = Path(sys.executable).parent / "mlx.launch"
    return [str(launcher), "-n", str(ranks), "--backend", "ring", "-p", str(port), "--", *command]
COPY_TRIES = 3  # copy_bandwidth's measurements, the best kept


# ----------------------------------------------------------------- the run

def environment() -> dict:
    commit = os.environ.get("COMMIT")
    if not commit:
        try:
            # "-dirty" where the files differ from the commit (a copy of a checkout, a local edit)
            commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    device = info.get("device_name") or info.get("architecture") or platform.processor() or platform.machine()
    kernels_note = "" if backend() == device_backend() else " (custom kernels off: DSV41_MLX_KERNELS=0)"
    return {"date": datetime.date.today().isoformat(), "device": str(device),
            "backend": device_backend() + kernels_note, "mlx": mx.__version__, "commit": commit}


def print_heading(title: str, env: dict, with_backend: bool = True) -> None:
    """A benchmark table's heading: what it measures, and where and when (environment)."""
    where = f"{env['device']}, {env['backend']}" if with_backend else env["device"]
    print(f"### {title} ({env['date']}, {where}, MLX {env['mlx']}, commit {env['commit']})\n")


def prompt_texts(n_prompts: int) -> list[str]:
    """The first n_prompts prose and the first n_prompts code prompts of scripts/prompts.json."""
    prompts = json.loads((ROOT / "scripts" / "prompts.json").read_text())
    return prompts["prose"][:n_prompts] + prompts["code"][:n_prompts]


def prompt_of(n: int, vocab: int) -> list[int]:
    """A made-up prompt: n token ids spread over the vocabulary."""
    return [((i * 7919) % 50000 + 100) % vocab for i in range(n)]


def reply_hash(tokens: list) -> str:
    """A reply's token ids (or several replies') as a short hash: equal replies, equal hashes."""
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:12]


# ----------------------------------------------------------------- timing

def evaluation_seconds(outputs) -> float:
    """Seconds to evaluate outputs' lazy graph, the device idle before and finished after."""
    mx.synchronize()
    tic = time.perf_counter()
    mx.eval(outputs)
    mx.synchronize()
    return time.perf_counter() - tic


def timed(make_outputs, calls: int = 20, reps: int = 7) -> float:
    """Median seconds per call: `calls` calls built into one graph, evaluated together, `reps` times."""
    mx.eval(make_outputs(0))  # warm-up (compilation, allocation)
    return statistics.median(
        evaluation_seconds([make_outputs(rep * calls + i) for i in range(calls)]) / calls for rep in range(reps))


def chained(gemm, x0: mx.array, links: int = 40, reps: int = 3) -> float:
    """Median seconds per GEMM when each waits for the one before, as a forward's GEMMs do
    (`timed`'s calls are independent, and a GPU may overlap them). Link i takes x, runs
    y = gemm(x, i) and feeds x0 + 0 * (a value of y) to link i + 1; the same chain with y = x
    is timed too and its cost per link (two element-wise operations) subtracted. y may have
    any shape (a kernel may return only a padded forward's real rows)."""
    def chain(step):
        x = x0
        for i in range(links):
            y = step(x, i).reshape(-1)[:1]  # (views: no launch)
            x = x0 + (y * 0).astype(x0.dtype)
        return x

    def per_link(step):
        return statistics.median(evaluation_seconds(chain(step)) / links for _ in range(reps))

    per_link(gemm)  # warm-up
    return per_link(gemm) - per_link(lambda x, i: x)


def host_probe_ms(reps: int = 5) -> float:
    """A fixed piece of pure-Python work (no MLX), the median of reps timings, in ms: how fast
    the host's CPU runs right now. A virtual machine's host may run slower for stretches of
    tens of decode steps, and a step's host side with it; e2e takes it around every prompt so
    that a slow run shows."""
    times = []
    for _ in range(reps):
        tic, total = time.perf_counter(), 0
        for i in range(20_000):
            total += i
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3


# ----------------------------------------------------------------- floors

def copy_bandwidth(nbytes: int = 1 << 30, tries: int = COPY_TRIES) -> float:
    """Bytes per second of a device copy (read + write), the ceiling the floors are computed from:
    the best of `tries` measurements, each the median of 5 evaluations of 5 copies. Something
    else on the device or host only slows a measurement, so the best is the steadiest ceiling."""
    a = mx.random.uniform(shape=(nbytes // 4,))
    mx.eval(a)
    t = min(timed(lambda i: a + float(i), calls=5, reps=5) for _ in range(tries))
    return 2 * nbytes / t


def experts_taken(n_experts: int, k: int, rows: int) -> float:
    """Routed experts `rows` rows take in all, on average, if each row picks its k of the
    n_experts independently and uniformly (what a random-weight router comes near): an
    expert is left out by all rows with probability (1 - k / n_experts) ** rows. One row: k."""
    return float(k) if rows == 1 else n_experts * (1 - (1 - k / n_experts) ** rows)


def decode_bytes(model, rows: int = 1) -> tuple[float, float]:
    """(bytes a forward of `rows` decode rows must read, of which routed experts): every dense
    weight of the backbone and the head once, the embedding rows, and the routed experts the
    rows take (one row: its top-k a layer; more: experts_taken, each expert read once for all
    the rows that picked it, as fp4_experts reads it)."""
    args = model.args
    total = experts = 0
    for i, layer in enumerate(model.layers):
        n_experts, k = args.moe_shape(i)
        for name, v in tree_flatten(layer.parameters()):
            if ".experts." in name:
                per_expert = v.nbytes // v.shape[0]
                experts += per_expert * experts_taken(n_experts, k, rows)
            else:
                total += v.nbytes
    head = model.head.weight.nbytes  # the release's BF16 head, read as it is stored (deepseek_v41.Head)
    total += experts + head + rows * model.embed.weight.nbytes // args.vocab_size
    return total, experts


# ------------------------------------------------- release shapes and weights

RELEASE_DSPARK_EXPERTS = {"dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3}  # the release's


def flash_args():
    """The flash-shaped model's ModelArgs (scripts/make_flash_shaped.py: the release's shapes)."""
    from dsv41_mlx.config import ModelArgs
    from scripts.make_flash_shaped import flash_config

    return ModelArgs.from_dict(flash_config())


def quantised_gemm_shapes() -> tuple[set, set, set]:
    """(dense mxfp8 (in, out), grouped wo_a (groups, in, out), mxfp4 experts (experts, in, out))
    of every quantised GEMM in the flash-shaped model (its dense shapes are the release's)."""
    from dsv41_mlx.io.load import build_model
    from dsv41_mlx.models.attention import Attention
    from dsv41_mlx.models.moe import Fp4Stack
    from dsv41_mlx.quant import Fp8Linear

    model = build_model(flash_args())  # the DSpark stages too; weights are lazy zeros: nothing is allocated
    dense, grouped, experts = set(), set(), set()
    for _, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            dense.add((m.weight.shape[1] * 4, m.weight.shape[0]))
        elif isinstance(m, Fp4Stack):
            experts.add((m.weight.shape[0], m.weight.shape[2] * 8, m.weight.shape[1]))
        if isinstance(m, Attention):
            grouped.add((m.n_groups, m.wo_a.weight.shape[1] * 4, m.o_lora_rank))
    return dense, grouped, experts


def release_ropes() -> tuple:
    """The flash-shaped (release) model's attention RoPEs as attention.Attention picks them:
    (a compressed layer's, YaRN; a window-only layer's, plain)."""
    from dsv41_mlx.models.attention import Attention

    args = flash_args()
    ratios = args.compress_ratios[: args.num_hidden_layers]
    compressed, window_only = next(i for i, r in enumerate(ratios) if r), ratios.index(0)
    return Attention(args, compressed).rope, Attention(args, window_only).rope  # lazy zero weights: no memory


def release_shaped_drafter_model(backbone_layers: int = 3):
    """A model whose drafter (3 stages, FP8/FP4 formats), embedding and head have the release's
    shapes, with random weights, built in memory; the backbone is a few plain window layers
    (the propose pass never runs it)."""
    from mlx.utils import tree_unflatten

    from dsv41_mlx.config import ModelArgs
    from dsv41_mlx.io.load import build_model
    from dsv41_mlx.io.tiny import TINY_TEXT_CONFIG
    from scripts.make_flash_shaped import RELEASE_TEXT

    text = {**TINY_TEXT_CONFIG, **RELEASE_TEXT, **RELEASE_DSPARK_EXPERTS, "num_hidden_layers": backbone_layers,
            "compress_ratios": [0] * (backbone_layers + 3), "kv_source_layer_ids": [],
            "index_source_layer_ids": [], "candidate_source_layer_id": -1, "engram_layer_ids": [],
            "engram_num_embeddings": [], "dspark_target_layer_ids": list(range(backbone_layers))[-3:],
            "n_routed_experts": 8, "num_experts_per_tok": 2}
    args = ModelArgs.from_dict({"model_type": "deepseek_v41", "text_config": text,
                                "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32],
                                                        "scale_fmt": "ue8m0", "expert_dtype": "fp4"}})
    model = build_model(args)
    new = []
    for name, v in tree_flatten(model.parameters()):
        if v.dtype == mx.uint32 and name.endswith("weight"):  # packed FP8 / FP4 codes
            fp4 = ".experts." in name
            codes = mx.random.randint(0, 256 if fp4 else 127, (v.size * 4,)).astype(mx.uint8)
            v = codes.view(mx.uint32).reshape(v.shape)
        elif v.dtype == mx.uint8:  # E8M0 scales: 2**-7
            v = mx.full(v.shape, 120, dtype=mx.uint8)
        elif mx.issubdtype(v.dtype, mx.floating):
            v = (mx.random.normal(v.shape) * 0.02).astype(v.dtype)
        new.append((name, v))
        mx.eval(v)
    model.update(tree_unflatten(new))
    return model


def random_words(shape, fp4: bool = False) -> mx.array:
    """Random weight codes packed as MLX stores them (uint32 words of 4 E4M3 or 8 E2M1 codes),
    without E4M3's NaN codes S.1111.111 (one would make a whole output row NaN on every side
    of a comparison, which then compares nothing)."""
    codes = mx.random.randint(0, 256, shape[:-1] + (shape[-1] * 4,)).astype(mx.uint8)
    if not fp4:
        codes = mx.where((codes & 0x7F) == 0x7F, codes - 1, codes)
    return codes.view(mx.uint32)


def random_scales(shape) -> mx.array:
    """Random E8M0 weight scales, 2**-15 to 2**-4."""
    return mx.random.randint(112, 124, shape).astype(mx.uint8)


# ------------------------------------------------------------ operation counts

VIEWS = {"Split", "Broadcast", "Reshape", "Squeeze", "ExpandDims", "Slice", "View", "Transpose", "AsStrided", "Copy",
         "Flatten", "Unflatten"}


def graph_dot(*outputs) -> str:
    """The lazy graph behind outputs in Graphviz text, MLX's export (nothing is evaluated)."""
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return f.read()


def graph_ops(*outputs) -> collections.Counter:
    """Primitive counts of the lazy graph behind outputs (nothing is evaluated)."""
    labels = re.findall(r'label\s*=\s*"([^"]+)"', graph_dot(*outputs))
    return collections.Counter(label.split()[0] for label in labels)


def launches(ops) -> int:
    """How many of graph_ops' primitives launch work on the device: all but the VIEWS."""
    return sum(v for k, v in ops.items() if k not in VIEWS)


def layer_kind(layer) -> str:
    attn = layer.attn
    return ("engram + " if hasattr(layer, "engram") else "") + (
        "window only" if not attn.ratio else
        f"ratio {attn.ratio}" + (" KV source" if attn.is_kv_source else "") + (" + indexer" if attn.is_index_source else ""))


def decode_by_layer(model, token: int, cache, on_layer, decode_rows: int | None = None) -> mx.array:
    """One decode step of `token` through the model's steps (Model.start, take_tokens, block,
    finish), padded as Runner.decode pads it under Options(decode_rows=decode_rows) (each row
    over its own window where set), calling on_layer(i, run) for each block, where run()
    builds block i and returns its outputs (the stream, the next pre-mix) and on_layer
    returns them; returns the logits."""
    rows = decode_rows or 1
    tokens = [token] * rows
    forward = model.start(mx.array([tokens], dtype=mx.int32), cache, 1, decode_rows is not None)
    engram_rows = model.take_tokens(cache, tokens, 1)
    for i in range(len(model.layers)):
        def run(i=i):
            model.block(i, forward, cache, engram_rows.get(i))
            return forward.h, forward.pre
        forward.h, forward.pre = on_layer(i, run)
    logits, _ = model.finish(forward)
    cache.trim(rows - 1)
    return logits


# ------------------------------------------------------------ layout choices

@contextlib.contextmanager
def layout_choices(choices: dict):
    """Inside: the kernels launch with the current layout's fields named in `choices` (name ->
    value: dsv41_mlx.kernels.tuning.Layout's) replaced; restored on the way out."""
    with tuning.using(replace(tuning.current(), **choices)):
        yield


# ------------------------------------------------------------ stand-in drafters

class WrappedDrafter:
    """A stand-in for a runtime Drafter around a real one, whose rings it keeps: make_cache,
    ingest and ingest_ahead are the real drafter's, and so is propose where a stand-in keeps
    it. A stand-in changes what is proposed, or watches it."""

    def __init__(self, drafter):
        self.inner = drafter
        self.block, self.window = drafter.block, drafter.window
        self.outlook = None  # a stand-in's drafts are its own: so is what they have shown

    @property
    def verify_costs(self):
        """The real drafter's: the target's verify forwards cost the same whoever drafts, so a
        scheduled decoder measures them once, for the drafter and every stand-in around it."""
        return self.inner.verify_costs

    @verify_costs.setter
    def verify_costs(self, costs):
        self.inner.verify_costs = costs

    def make_cache(self):
        return self.inner.make_cache()

    def ingest(self, cache, features):
        self.inner.ingest(cache, features)

    def ingest_ahead(self, cache, features):
        return self.inner.ingest_ahead(cache, features)

    def catch_up(self, cache, features):
        self.inner.catch_up(cache, features)

    def propose(self, cache, anchor, pick):
        return self.inner.propose(cache, anchor, pick)


class OracleDrafter(WrappedDrafter):
    """A drafter that knows the continuation: it proposes `sequence`'s own tokens (the target's
    reply, found beforehand), wrong now and then, so that the engine runs at a chosen
    acceptance. With a `rate`, each draft is right with that probability, drawn from a
    generator seeded with `seed`; without one, the draft at every `wrong_every`-th position is
    wrong. A wrong draft is the right token + 1. Its confidence in each draft is the rate its
    drafts are right at (a calibrated drafter, as the `schedule` verify policy wants), its
    logits all on the draft itself. Its figures are labelled as the oracle's wherever they are
    reported."""

    def __init__(self, drafter, sequence: list[int], rate: float | None = None, seed: int = 0,
                 wrong_every: int = 7):
        import numpy as np

        super().__init__(drafter)
        self.sequence, self.vocab = sequence, drafter.model.args.vocab_size
        self.rng = None if rate is None else np.random.default_rng(seed)
        self.rate, self.wrong_every = (1 - 1 / wrong_every, wrong_every) if rate is None else (rate, None)
        self.right = self.made = 0  # drafts made equal to the continuation, of all made

    def propose(self, cache, anchor, pick):
        from dsv41_mlx.runtime.drafter import Proposal

        drafts = []
        for k in range(self.block):
            pos = cache.end + 1 + k
            token = self.sequence[pos] if pos < len(self.sequence) else 0
            right = pos % self.wrong_every != 0 if self.rng is None else self.rng.random() < self.rate
            drafts.append(token if right else (token + 1) % self.vocab)
            self.right, self.made = self.right + right, self.made + 1
        rate = self.rate
        confidence = math.log(rate / (1 - rate)) if 0 < rate < 1 else (30.0 if rate else -30.0)
        drafts = mx.array(drafts, dtype=mx.int32)
        return Proposal(drafts, mx.zeros((self.block, 1)), mx.full((self.block,), confidence),
                        candidates=drafts[:, None])


class OracleDecoders:
    """Speculative decoders drafted by OracleDrafters at one rate, one per reply (each oracle
    knows its own reply), which share one Outlook per verify policy: what the oracle's rounds
    have shown carries from one reply to the next, as a real drafter keeps its outlook across
    generations (SpeculativeDecoder). Without it each reply's schedule would start from
    nothing, a probe of one draft first, where the checkpoint's drafter starts from what it
    has seen."""

    def __init__(self, runner, rate: float):
        self.runner, self.rate = runner, rate
        self.outlooks = {}  # verify policy -> the Outlook its decoders share

    def __call__(self, params, sequence: list[int], confidence: str = "off", verify_costs=None,
                 verify_ahead: bool | None = None):
        from dsv41_mlx.speculative import SpeculativeDecoder

        oracle = OracleDrafter(self.runner.drafter, sequence, self.rate, seed=len(sequence))
        oracle.outlook = self.outlooks.get(confidence)
        decoder = SpeculativeDecoder(self.runner, oracle, params, confidence=confidence, verify_costs=verify_costs,
                                     verify_ahead=verify_ahead)
        self.outlooks[confidence] = oracle.outlook
        return decoder
