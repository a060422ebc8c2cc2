"""Write the embedded default checkpoint (release format, tiny sizes) into a directory.

    python scripts/make_tiny_checkpoint.py OUT_DIR [--seed 0]

The same code builds the default that `python -m dsv41_mlx.generate` uses when
no --model is given (dsv41_mlx.tiny).
"""

import argparse

from dsv41_mlx.io.tiny import build_checkpoint

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_checkpoint(args.out_dir, seed=args.seed))
