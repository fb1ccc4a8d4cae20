#!/usr/bin/env bash
# Install the current npm releases of the two agent CLIs used by
# benchmarks/agents/run_agents.sh into a prefix OUTSIDE the repository.
#
#   AGENTS_DIR   npm prefix (default /work/agents); binaries land in $AGENTS_DIR/bin
#   CLAUDE_PKG   package spec for Claude Code   (default @anthropic-ai/claude-code@latest)
#   CODEX_PKG    package spec for Codex CLI      (default @openai/codex@latest)
#
# Both packages pull their native binary from a platform sub-package that npm
# installs as an optional dependency (e.g. @anthropic-ai/claude-code-linux-x64,
# @openai/codex-linux-x64 -> npm:@openai/codex@<v>-linux-x64), so only the npm
# registry is needed. Afterwards: export PATH="$AGENTS_DIR/bin:$PATH".
set -euo pipefail

AGENTS_DIR="${AGENTS_DIR:-/work/agents}"
CLAUDE_PKG="${CLAUDE_PKG:-@anthropic-ai/claude-code@latest}"
CODEX_PKG="${CODEX_PKG:-@openai/codex@latest}"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$AGENTS_DIR"
abs_dir="$(cd "$AGENTS_DIR" && pwd)"
case "$abs_dir/" in
  "$repo_root"/*) echo "AGENTS_DIR ($abs_dir) must be outside the repository ($repo_root)" >&2; exit 2 ;;
esac

command -v npm >/dev/null || { echo "npm not found (apt-get install nodejs npm)" >&2; exit 2; }

# --include=optional makes sure the platform binary packages come along even
# if the user's npm config omits optional deps.
npm install --global --prefix "$abs_dir" --include=optional --no-fund --no-audit \
  "$CLAUDE_PKG" "$CODEX_PKG"

export PATH="$abs_dir/bin:$PATH"

# Newer npm releases may skip postinstall scripts that are not allow-listed;
# Claude Code's postinstall copies the native binary over bin/claude.exe.
# Run it by hand if the placeholder is still there.
if ! DISABLE_AUTOUPDATER=1 claude --version >/dev/null 2>&1; then
  (cd "$abs_dir/lib/node_modules/@anthropic-ai/claude-code" && node install.cjs)
fi
echo "installed into $abs_dir/bin"
echo "claude: $(DISABLE_AUTOUPDATER=1 claude --version 2>&1 | head -n1)"
echo "codex:  $(codex --version 2>&1 | head -n1)"
