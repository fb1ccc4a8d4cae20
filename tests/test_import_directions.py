"""Imports run one way: server -> deploy -> engine front end -> engine loop -> core / worker ->
models -> layers -> attention -> kernels (docs/ARCHITECTURE.md, module map), and in no circle.
Inside the server: launch -> app / topology -> one package per API -> the shared modules.

Every `import` in tessera/ is read with ast (inside functions too; `if TYPE_CHECKING:` blocks,
which never run, are left out) and checked against what its package may not import. A new
import running the wrong way fails here with the file, the line and the rule it breaks; a new
circle of modules importing each other fails with the circle.
"""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path
from typing import Iterable, Optional

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
SERVER_TOP = ("tessera.server.app", "tessera.server.launch", "tessera.server.topology", "tessera.server.admin",
              "tessera.server.lora")
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
                              # grammar states stay with the scheduler; the runner applies bitmasks
                              "tessera.engine.core.structured_output",
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


# Circles inside tessera/server/ that its split into per-API packages removes: each entry the
# modules of one circle (a strongly connected set). Empty it as they go; the check fails for a
# circle not listed here and for a listed one that no longer exists. Nothing outside
# tessera/server/ may be listed.
def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_statements(path: Path, module: str) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, module, names) of each import in `module`'s file that can run (TYPE_CHECKING blocks
    skipped): `names` are what a `from` import takes from the module, empty for a plain `import`."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str, tuple[str, ...]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod, tuple(a.name for a in node.names)))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module) of each import in `module`'s file that can run; a `from pkg import name`
    gives both `pkg` and `pkg.name` (which may be a module)."""
    found: list[tuple[int, str]] = []
    for line, mod, names in _import_statements(path, module):
        found.append((line, mod))
        found.extend((line, f"{mod}.{name}") for name in names)
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


# ----------------------------------------------------------------------------- circles

def _import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of the package under `root` it imports. `from pkg import name` is an
    edge to the submodule pkg.name where that file exists, else to pkg; a package's __init__ is a
    node like any module, so a module that imports its own package counts only where that
    __init__ imports it back (an empty __init__ imports nothing)."""
    files = {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets: set[str] = set()
        for _, mod, names in _import_statements(path, module):
            for target in ([f"{mod}.{n}" if f"{mod}.{n}" in files else mod for n in names] if names else [mod]):
                if target in files and target != module:
                    targets.add(target)
        graph[module] = targets
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The sets of two or more modules that all reach each other (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.add(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(frozenset(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _one_cycle(graph: dict[str, set[str]], members: frozenset[str]) -> list[str]:
    """A shortest circle through the first of `members`, as the modules in import order."""
    start = min(members)
    came_from: dict[str, Optional[str]] = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & members):
            if w == start:
                path: list[str] = []
                at: Optional[str] = v
                while at is not None:
                    path.append(at)
                    at = came_from[at]
                return [*reversed(path), start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"{sorted(members)} is not strongly connected")


def _describe(graph: dict[str, set[str]], circles: Iterable[frozenset[str]]) -> str:
    lines = []
    for members in sorted(circles, key=sorted):
        line = " -> ".join(_one_cycle(graph, members))
        if len(members) > 2:
            line += f"  (one circle of {len(members)} modules: {', '.join(sorted(members))})"
        lines.append("  " + line)
    return "\n".join(lines)


def test_no_import_cycles() -> None:
    graph = _import_graph()
    circles = _strongly_connected(graph)
    assert not circles, "modules importing each other in a circle:\n" + _describe(graph, circles)


def test_the_cycle_check_finds_a_circle(tmp_path: Path) -> None:
    """The checker itself, on a small package: a circle through `from pkg import module` and a
    function's import is found; a TYPE_CHECKING import and an import of an empty parent
    package are not circles."""
    root = tmp_path / "tessera"
    (root / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "sub/__init__.py": "",
        "sub/a.py": "from tessera.sub import b\n",
        "sub/b.py": "def f():\n    from . import c\n",
        "sub/c.py": "import tessera.sub\nfrom tessera.sub.a import thing\n",
        "sub/d.py": "from typing import TYPE_CHECKING\nfrom tessera.sub import c\nif TYPE_CHECKING:\n"
                    "    from tessera.sub import d2\n",
        "sub/d2.py": "from tessera.sub.d import x\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    graph = _import_graph(root)
    assert graph["tessera.sub.c"] == {"tessera.sub", "tessera.sub.a"}  # `thing` is no module: its module
    circles = _strongly_connected(graph)
    assert circles == [frozenset({"tessera.sub.a", "tessera.sub.b", "tessera.sub.c"})]
    assert _one_cycle(graph, circles[0]) == ["tessera.sub.a", "tessera.sub.b", "tessera.sub.c", "tessera.sub.a"]
    (root / "sub/__init__.py").write_text("from tessera.sub.c import y\n")  # now the package is in it
    assert _strongly_connected(_import_graph(root)) == [
        frozenset({"tessera.sub", "tessera.sub.a", "tessera.sub.b", "tessera.sub.c"})]
