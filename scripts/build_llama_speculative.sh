#!/usr/bin/env bash
# Build llama.cpp's `llama-speculative-simple` (its draft-model speculation example) from the llama.cpp source tree
# vendored in the llama-cpp-python sdist -- the same llama.cpp the `specloom[llama]` extra builds -- for
# `specloom bench --baseline llama.cpp-draft`. CPU flags from scripts/ggml_cpu_flags.sh (this CPU's instruction sets, no
# AMX: the native build died with SIGILL on an AMX Xeon), as scripts/install_llama_cpp.sh builds the pip peer;
# static, no network code.
#
#   bash scripts/build_llama_speculative.sh [OUT_DIR]      # default ~/.cache/specloom/llama.cpp
#   LLAMA_CPP_SDIST=/path/llama_cpp_python-0.3.36.tar.gz  # use a downloaded sdist instead of `pip download`
#   JOBS=2                                                # parallel compile jobs (default: nproc)
#
# The program lands in OUT_DIR/bin/llama-speculative-simple, where specloom looks for it (or set
# SPECLOOM_LLAMA_SPECULATIVE to its path). About 5-10 minutes on 2 cores.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
OUT=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/specloom/llama.cpp}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SRC="$OUT/src"
sdist=${LLAMA_CPP_SDIST:-}
if [ -z "$sdist" ]; then
    sdist="$OUT/llama_cpp_python-$VERSION.tar.gz"
    [ -f "$sdist" ] || pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$OUT"
fi
if [ ! -d "$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp" ]; then
    mkdir -p "$SRC"
    tar xzf "$sdist" -C "$SRC"
fi
LLAMA="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$LLAMA" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
    $(bash "$(dirname "$0")/ggml_cpu_flags.sh")
cmake --build "$OUT/build" --target llama-speculative-simple -j "$JOBS"
mkdir -p "$OUT/bin"
cp "$OUT/build/bin/llama-speculative-simple" "$OUT/bin/"
echo "built $OUT/bin/llama-speculative-simple"
