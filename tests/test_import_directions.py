"""Imports run one way: server -> deploy -> engine front end -> engine loop -> core / worker ->
models -> layers -> attention -> kernels (docs/ARCHITECTURE.md, module map). Inside the server:
launch -> app / topology -> one package per API -> the shared modules.

Every `import` in tessera/ is read with ast (inside functions too; `if TYPE_CHECKING:` blocks,
which never run, are left out) and checked against what its package may not import. A new
import running the wrong way fails here with the file, the line and the rule it breaks.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "tessera"

ENGINE_VOCABULARY = ("tessera.engine.errors", "tessera.engine.outputs", "tessera.engine.stats")
ENGINE_LOOP = ("tessera.engine.build", "tessera.engine.llm_engine", "tessera.engine.spec_decode",
               "tessera.engine.input_processor", "tessera.engine.output_processor")
ABOVE_ENGINE = ("tessera.server", "tessera.deploy", "tessera.bench", "tessera.cli", "tessera.llm")

# The server: one package per API (each may use OpenAI's, the conversion core, and no other),
# shared modules below them, and on top the app (routes), the topology (engines) and launch.
OPENAI = "tessera.server.openai"
SERVER_APIS = (OPENAI, "tessera.server.responses", "tessera.server.anthropic", "tessera.server.ollama",
               "tessera.server.tokenize")
OPENAI_HANDLERS = tuple(f"{OPENAI}.{m}" for m in ("chat", "completions", "embeddings", "router"))
SERVER_TOP = ("tessera.server.app", "tessera.server.launch", "tessera.server.topology", "tessera.server.admin")
SERVER_SHARED = tuple(f"tessera.server.{m}" for m in (
    "access_log", "auth", "config", "endpoint", "errors", "generation", "model_router", "output",
    "output_parsers", "ratelimit", "serving", "tools", "traffic", "transport", "ui"))

# package (or module) -> prefixes it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "tessera.kernels": ("tessera.attention", "tessera.layers", "tessera.models", "tessera.engine") + ABOVE_ENGINE,
    "tessera.attention": ("tessera.layers", "tessera.models", "tessera.engine") + ABOVE_ENGINE,
    "tessera.layers": ("tessera.models", "tessera.engine") + ABOVE_ENGINE,
    "tessera.models": ("tessera.engine",) + ABOVE_ENGINE,
    # The engine's shared vocabulary: plain records and errors, nothing that runs.
    **{m: ("tessera.engine.core", "tessera.engine.worker", "tessera.engine.frontend") + ENGINE_LOOP + ABOVE_ENGINE
       for m in ENGINE_VOCABULARY},
    # The core decides; it never runs a model nor knows who drives it.
    "tessera.engine.core": ("tessera.engine.worker", "tessera.engine.frontend", "tessera.models", "tessera.layers")
    + ENGINE_LOOP + ABOVE_ENGINE,
    # The worker executes what the scheduler's plain output says: no request objects, no scheduler.
    "tessera.engine.worker": ("tessera.engine.core.request", "tessera.engine.core.request", "tessera.engine.core.scheduler",
                              "tessera.engine.core.kv_cache_manager", "tessera.engine.core.block_pool",
                              "tessera.engine.frontend") + ENGINE_LOOP + ABOVE_ENGINE,
    **{m: ("tessera.engine.frontend",) + ABOVE_ENGINE for m in ENGINE_LOOP},
    "tessera.engine.frontend": ABOVE_ENGINE,
    "tessera.deploy": ("tessera.server", "tessera.bench", "tessera.cli"),
    **{api: tuple(a for a in SERVER_APIS if a not in (api, OPENAI)) + SERVER_TOP for api in SERVER_APIS},
    # The shared server modules know OpenAI's protocol (the vocabulary every API converts into)
    # and nothing of any API's handlers, nor of the app or the topology.
    **{m: tuple(a for a in SERVER_APIS if a != OPENAI) + OPENAI_HANDLERS + SERVER_TOP for m in SERVER_SHARED},
    "tessera.server.app": ("tessera.server.launch", "tessera.server.topology"),
    "tessera.server.topology": ("tessera.server.app", "tessera.server.launch") + SERVER_APIS,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module) of each import in `module`'s file that can run (TYPE_CHECKING blocks skipped)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
            found.extend((node.lineno, f"{mod}.{a.name}") for a in node.names)  # `from pkg import module`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _rules_for(module: str) -> tuple[str, ...]:
    rules: tuple[str, ...] = ()
    for owner, banned in FORBIDDEN.items():
        if module == owner or module.startswith(owner + "."):
            rules += banned
    return rules


def _matches(imported: str, prefix: str) -> bool:
    return imported == prefix or imported.startswith(prefix + ".")


def _violations() -> list[str]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        rules = _rules_for(module)
        for line, imported in _imports(path, module):
            for prefix in rules:
                if _matches(imported, prefix) and not _matches(imported, module):
                    out.append(f"{path.relative_to(ROOT.parent)}:{line}: {module} imports {imported} "
                               f"({prefix} is above it)")
    return sorted(set(out))


def test_imports_run_one_way() -> None:
    bad = _violations()
    assert not bad, "imports against the module map:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", ["tessera.engine.core", "tessera.engine.worker", "tessera.engine.frontend",
                                     "tessera.deploy", *SERVER_APIS, "tessera.server.output_parsers"])
def test_the_mapped_packages_exist(package: str) -> None:
    """The rules name real packages (a rename that left a rule behind would make it vacuous)."""
    assert (ROOT.parent / package.replace(".", "/") / "__init__.py").is_file()


@pytest.mark.parametrize("module", [*SERVER_SHARED, *SERVER_TOP, *OPENAI_HANDLERS])
def test_the_mapped_server_modules_exist(module: str) -> None:
    path = ROOT.parent / module.replace(".", "/")
    assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_the_check_catches_a_wrong_way_import(tmp_path: Path) -> None:
    """The checker itself: a worker module importing the request is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tessera.server import app\n"
                   "def f():\n    from tessera.engine.core.request import Request\n")
    imports = _imports(bad, "tessera.engine.worker.bad")
    assert (5, "tessera.engine.core.request") in imports
    assert all(not m.startswith("tessera.server") for _, m in imports)
    assert any(_matches("tessera.engine.core.request", p) for p in _rules_for("tessera.engine.worker.runner"))
    # one API's package using another's (other than OpenAI's core) or a shared module using a handler
    assert any(_matches("tessera.server.responses.protocol", p) for p in _rules_for("tessera.server.anthropic.protocol"))
    assert not any(_matches("tessera.server.openai.protocol", p) for p in _rules_for("tessera.server.ollama.serving"))
    assert any(_matches("tessera.server.openai.chat", p) for p in _rules_for("tessera.server.serving"))
