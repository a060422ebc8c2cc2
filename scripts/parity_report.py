"""End-to-end parity report against the reference goldens (prints; asserts nothing).

    python scripts/parity_report.py

Runs the fixture's prefill and its 12 teacher-forced decode steps through the
model and prints, per call, the max |logit error| as a fraction of the golden
logit std and whether the argmax agrees, against the pinned-index-keys variant
(the semantics this package implements; its prefill equals the reference's).
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
from safetensors.numpy import load_file

from dsv41_mlx import load

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "reference-v41-tiny"


def main():
    model, _ = load(FIXTURE)
    golden = load_file(FIXTURE / "golden.safetensors")
    pinned = load_file(FIXTURE / "golden_variant_pinned_index_keys.safetensors")
    cache = model.make_cache()
    logits, _ = model(mx.array(golden["prompt_ids"].astype(np.int32)), cache)
    rows = [("prefill", np.array(logits[0, -1]), golden["prefill.last_logits"][0])]
    for t in range(pinned["decode.input_ids"].shape[0]):
        ids = mx.array(pinned["decode.input_ids"][t].astype(np.int32))
        logits, _ = model(ids, cache)
        rows.append((f"decode {t:2d}", np.array(logits[0, -1]), pinned["decode.logits"][t, 0]))
    for name, ours, ref in rows:
        err = np.abs(ours - ref).max() / ref.std()
        print(f"{name}: max|err| = {err:6.1%} of std, argmax {'same' if ours.argmax() == ref.argmax() else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
