"""Command lines a test runs side by side: each in a process of its own, as many at once as
the machine has cores, so that a test of several runs waits for about its slowest."""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor


def run_all(commands: list[list[str]], **kwargs) -> list[subprocess.CompletedProcess]:
    """subprocess.run(command, capture_output=True, text=True, **kwargs) of every command, the
    results in the commands' order."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(lambda c: subprocess.run(c, capture_output=True, text=True, **kwargs), commands))
