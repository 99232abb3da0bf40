#!/bin/sh
# Build llama.cpp's llama-mtmd-cli, llama-server and llama-quantize from the copy vendored in the
# llama-cpp-python sdist on PyPI (the only route to llama.cpp's source from here), into
# $QVLD_BENCH_CACHE/llama.cpp (default ~/.cache/qvld-bench). Idempotent: a finished build
# is kept. Usage: bench/build_llamacpp.sh [PYTHON]
# The ISA is named rather than -march=native: ggml's AMX path (which native turns on where
# the CPU has AMX) dies of SIGILL in tilezero on this project's VMs, so AVX-512 (with
# VNNI, without BF16, which GCC 12 cannot compile in llamafile's sgemm) is the top.
set -eu
python=${1:-python3}
cache=${QVLD_BENCH_CACHE:-$HOME/.cache/qvld-bench}
dest=$cache/llama.cpp
stamp=$dest/build/.qvld-build-no-amx-server
if [ -f "$stamp" ]; then
    echo "llama.cpp already built in $dest"
    exit 0
fi
mkdir -p "$cache"
work=$(mktemp -d "$cache/.llamacpp-src.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python -d "$work"
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
rm -rf "$dest"
mv "$work"/llama_cpp_python-*/vendor/llama.cpp "$dest"
avx512=OFF
grep -qw avx512f /proc/cpuinfo && avx512=ON
vnni=OFF
grep -qw avx512_vnni /proc/cpuinfo && vnni=ON
cmake -S "$dest" -B "$dest/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_AVX512="$avx512" -DGGML_AVX512_VBMI="$avx512" -DGGML_AVX512_VNNI="$vnni" \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF
cmake --build "$dest/build" --target llama-mtmd-cli llama-server llama-quantize -j "$(nproc)"
touch "$stamp"
echo "built $dest/build/bin/llama-mtmd-cli and llama-server"
