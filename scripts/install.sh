#!/usr/bin/env bash
# Create the virtual environment and install Tessera into it, CPU torch first.
#
# torch is installed explicitly before the project so that pip never resolves
# it on its own (which would fetch a multi-GB CUDA build on a CPU machine).
# Re-running is quick: a stamp records what was installed and from which
# pyproject.toml, and nothing is done while it still matches.
#
# Environment:
#   VENV             venv folder (default .venv)
#   PYTHON           interpreter that creates the venv (default python3)
#   TORCH_INDEX_URL  where to get torch (default: a local CPU wheel if pip has
#                    one, else https://download.pytorch.org/whl/cpu). GPU users:
#                    set it to a CUDA index, e.g. https://download.pytorch.org/whl/cu128,
#                    or install the CUDA torch==2.13.0 wheel into the venv first.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
stamp="$VENV/.tessera-install-stamp"
want="torch=$TORCH_VERSION index=${TORCH_INDEX_URL:-auto} $(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || { echo "error: Tessera needs Python 3.10 or newer ($PYTHON is older); set PYTHON=python3.11" >&2; exit 1; }
    echo "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
py="$VENV/bin/python"
pip=("$py" -m pip --disable-pip-version-check)

have_torch() {
    "$py" - "$TORCH_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version("torch").split("+")[0] == sys.argv[1] else 1)
PY
}

if have_torch; then
    echo "torch $TORCH_VERSION already installed"
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${pip[@]}" install "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
elif "${pip[@]}" install --quiet --no-index --no-deps "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
    # pip's configuration offers a local CPU wheel; now let it fetch torch's own dependencies.
    "${pip[@]}" install "torch==$TORCH_VERSION+cpu"
else
    "${pip[@]}" install "torch==$TORCH_VERSION" --index-url "$CPU_INDEX"
fi

"${pip[@]}" install -e ".[test]"
have_torch || { echo "error: torch $TORCH_VERSION is not installed in $VENV" >&2; exit 1; }
# The C kernels (tessera/kernels) are compiled for this CPU now rather than on first use;
# without a C compiler Tessera still runs, on PyTorch operators.
"$py" -m tessera.kernels build || echo "warning: C kernels not built; the sdpa attention backend will be used"
echo "$want" > "$stamp"
echo "installed Tessera into $VENV"
