"""The benchmarks of scripts/bench.py, one module each, on a shared harness (harness.py)."""
