"""The release's layers split over N pipeline ranks: each rank's layers and resident bytes.

    python scripts/pipeline_split.py [--ranks 2 3 4] [--experts 384]

Counts each layer's parameters as the model holds them (no checkpoint needed: the release's
config, scripts/make_flash_shaped.py, with its 384 routed experts); rank 0 also holds the
embedding, head, final norm and the DSpark stages. The split is the loader's default
(pipeline.balance over the layers a rank may start at); the engram tables stay memory-mapped
and are not counted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv41_mlx.config import ModelArgs  # noqa: E402
from dsv41_mlx.io.load import build_model  # noqa: E402
from dsv41_mlx.runtime.pipeline import balance, cut_points  # noqa: E402
from scripts.make_flash_shaped import flash_config  # noqa: E402


def resident(module) -> int:
    """Bytes of a module's parameters (arrays never evaluated here: shapes and dtypes only)."""
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def split_table(ranks_list: list[int], experts: int = 384) -> dict:
    args = ModelArgs.from_dict(flash_config(experts=experts, dspark_experts=128))
    model = build_model(args)
    layers = [resident(layer) for layer in model.layers]
    first = resident(model) - sum(layers)  # embedding, head, norm, DSpark stages
    out = {"total": first + sum(layers), "first_extra": first, "splits": {}}
    for ranks in ranks_list:
        ranges = balance(layers, first, ranks, cut_points(args))
        out["splits"][ranks] = [(r.start, r.stop, sum(layers[r.start:r.stop]) + (first if k == 0 else 0))
                                for k, r in enumerate(ranges)]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--experts", type=int, default=384)
    a = p.parse_args()
    res = split_table(a.ranks, a.experts)
    print(f"resident: {res['total'] / 1e9:.2f} GB in all; rank 0's embedding, head, norm and DSpark stages "
          f"{res['first_extra'] / 1e9:.2f} GB\n")
    print("| ranks | split | resident GB per rank | largest rank GB |")
    print("|---|---|---|---|")
    for ranks, rows in res["splits"].items():
        split = ",".join(f"{a}:{b}" for a, b, _ in rows)
        per = " / ".join(f"{n / 1e9:.1f}" for _, _, n in rows)
        print(f"| {ranks} | {split} | {per} | {max(n for *_, n in rows) / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
