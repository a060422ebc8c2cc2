"""Plain greedy decoding through the public API only (`load`, `stream_generate`), so that any
commit can run it: tok/s per prompt over three repeats, the replies' hashes, and whether the
drafted replies equal them. Compare commits by running it with each one's tree first on
PYTHONPATH, on the same machine:

    git worktree add /tmp/base COMMIT
    PYTHONPATH=/tmp/base python scripts/plain_decode.py DIR base base.json
    PYTHONPATH=$PWD python scripts/plain_decode.py DIR new new.json
"""

import hashlib
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

import dsv41_mlx
from dsv41_mlx import load, stream_generate

TOKENS, REPEATS = 48, 3


def main(model_dir: str, label: str, out: str) -> None:
    tree = Path(dsv41_mlx.__file__).resolve().parent.parent
    prompts = json.loads((Path(__file__).resolve().parent / "prompts.json").read_text())
    texts = [prompts["prose"][0], prompts["code"][0]]
    tic = time.perf_counter()
    model, tokenizer = load(model_dir)
    mx.eval(model.parameters())
    loaded = time.perf_counter() - tic
    tic = time.perf_counter()
    for text in texts:  # every shape traced and every kernel built before anything is timed
        list(stream_generate(model, tokenizer, text, max_tokens=6, draft=False))
    warm = time.perf_counter() - tic
    tps, hashes, replies = {0: [], 1: []}, {0: set(), 1: set()}, {}
    for _ in range(REPEATS):
        for i, text in enumerate(texts):
            tokens, last = [], None
            for last in stream_generate(model, tokenizer, text, max_tokens=TOKENS, draft=False):
                tokens.append(last.token)
            tps[i].append(last.generation_tps)
            hashes[i].add(hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:12])
            replies[i] = tokens
    drafted = {i: [r.token for r in stream_generate(model, tokenizer, text, max_tokens=TOKENS, draft=True)] == replies[i]
               for i, text in enumerate(texts)}
    result = {"label": label, "tree": str(tree), "device": str(mx.default_device()), "load_s": loaded, "warm_s": warm,
              "tps": tps, "median_tps": {i: sorted(v)[len(v) // 2] for i, v in tps.items()},
              "hashes": {i: sorted(h) for i, h in hashes.items()}, "drafted_equal": drafted,
              "prompt_tokens": [len(tokenizer.encode(t)) for t in texts]}
    print(json.dumps(result))
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: plain_decode.py MODEL_DIR LABEL OUT.json")
    main(*sys.argv[1:])
