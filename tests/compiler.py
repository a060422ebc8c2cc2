"""The C++ compiler the tests use: clang++ where it is on PATH, else the clang inside the
`ziglang` wheel (a test extra), so that `pip install -e ".[test]"` is all a machine needs.

`cxx()` gives one executable that takes clang++'s command line (the Metal type-check, the
host emulation of the kernels and tests/test_kernels.py call it so). zig's clang comes with
libc++ (as macOS's does), not GCC's libstdc++: the emulation headers (tests/emulation/) mind
the difference.
For zig the executable is a small script, written once into zig's cache folder, which runs
`zig c++` with:
- `-mcpu=baseline`: zig builds for the machine's own CPU by default (FMA where it has it,
  so float results that vary from machine to machine); clang++ builds for the baseline;
- `-fsyntax-only` done as a compile to a throw-away object: zig 0.17's `c++` reports a
  failure after a successful -fsyntax-only (it looks for an object that was never written);
  zig's debug-mode UB sanitizer is left off there, where nothing runs;
- ZIG_GLOBAL_CACHE_DIR / ZIG_LOCAL_CACHE_DIR set where unset: zig's own cache folder where it
  can be written, else one in the temporary folder (a read-only home, CI). zig builds its
  libc++ once into that cache (about a minute), then takes it from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

WRAPPER = """#!/bin/sh
# clang++ for the tests of dsv41_mlx, by zig c++ (written by tests/compiler.py)
if [ -z "${{ZIG_GLOBAL_CACHE_DIR:-}}" ]; then ZIG_GLOBAL_CACHE_DIR={cache}; fi
if [ -z "${{ZIG_LOCAL_CACHE_DIR:-}}" ]; then ZIG_LOCAL_CACHE_DIR=$ZIG_GLOBAL_CACHE_DIR; fi
export ZIG_GLOBAL_CACHE_DIR ZIG_LOCAL_CACHE_DIR
syntax=
for a do
  shift
  if [ "$a" = -fsyntax-only ]; then syntax=1; else set -- "$@" "$a"; fi
done
if [ -n "$syntax" ]; then
  out=$(mktemp -d) || exit 1
  {zig} c++ -mcpu=baseline -fno-sanitize=all "$@" -c -o "$out/syntax-only.o"
  status=$?
  rm -rf "$out"
  exit $status
fi
exec {zig} c++ -mcpu=baseline "$@"
"""


def zig() -> Path | None:
    """The zig binary of the installed `ziglang` wheel, or None."""
    spec = importlib.util.find_spec("ziglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "zig"
    return binary if os.access(binary, os.X_OK) else None


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def zig_cache() -> Path:
    """$ZIG_GLOBAL_CACHE_DIR, else zig's default ($XDG_CACHE_HOME/zig, ~/.cache/zig) where it
    can be written, else a folder of this user's in the temporary folder."""
    if os.environ.get("ZIG_GLOBAL_CACHE_DIR"):
        return Path(os.environ["ZIG_GLOBAL_CACHE_DIR"])
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zig"
    if _writable(default):
        return default
    return Path(tempfile.gettempdir()) / f"zig-cache-{os.getuid()}"


@lru_cache(maxsize=None)
def cxx() -> str | None:
    """A clang++ command (one executable): clang++ on PATH, else the zig wrapper; None when
    neither is there (the test extras are not installed)."""
    found = shutil.which("clang++")
    if found:
        return found
    binary = zig()
    if binary is None:
        return None
    cache = zig_cache()
    cache.mkdir(parents=True, exist_ok=True)
    text = WRAPPER.format(cache=shlex.quote(str(cache)), zig=shlex.quote(str(binary)))
    wrapper = cache / "dsv41_mlx" / f"clang++-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    if not (wrapper.exists() and wrapper.read_text() == text):
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=wrapper.parent, delete=False) as f:
            f.write(text)
        os.chmod(f.name, 0o755)
        os.replace(f.name, wrapper)  # another process may be writing the same text
    return str(wrapper)
