#!/usr/bin/env bash
# Install llama-cpp-python (the `specloom[llama]` peer) built for this host's CPU without ggml's AMX path, so that
# `specloom bench --baseline llama.cpp,llama.cpp-lookup` runs on every host kind we have (the default native build
# died with SIGILL on an AMX Xeon). About 5-10 minutes on 2 cores.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
CMAKE_ARGS="$(bash "$here/ggml_cpu_flags.sh")" pip install --force-reinstall --no-cache-dir --no-deps \
    "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
pip install "diskcache>=5.6.1" "jinja2>=2.11.3" "numpy>=1.20.0" "typing-extensions>=4.5.0"
python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed')"
