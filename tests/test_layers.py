"""The architecture as a test: no import cycles among the project's modules (imports inside functions count),
imports point down the layers, and programs know nothing of FastTTS (docs/structure.md)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sgl_tts", "programs", "policies", "eval")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for file in (ROOT / package).rglob("*.py"):
            parts = file.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file (a package's own __init__ excluded)."""
    found = modules()

    def resolve(name: str) -> str | None:
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, file in found.items():
        package = module if file.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                target = resolve(name)
                if target and target != module and not (module.startswith(target + ".")
                                                         and found[target].name == "__init__.py"):
                    targets.add(target)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


# The layers of docs/structure.md, bottom to top: a package imports only packages on its own layer or below,
# and packages on one layer do not import each other in a cycle. Top-level modules of `sgl_tts` count as packages.
LAYERS = (
    ("sgl_tts", "sgl_tts.registry", "sgl_tts.config", "sgl_tts.paths", "sgl_tts.env_names", "sgl_tts.graded_set",
     "sgl_tts.problems"),
    ("policies",),
    ("sgl_tts.runtime",),
    ("sgl_tts.frontend",),
    ("sgl_tts.scoring",),
    ("sgl_tts.search",),
    ("sgl_tts.fasttts",),
    ("sgl_tts.rsd",),
    ("sgl_tts.testing",),
    ("programs",),
    ("sgl_tts.measure",),
    ("sgl_tts.app",),
    ("sgl_tts.bench", "sgl_tts.serve"),
    ("eval",),
    ("sgl_tts.cli",),
)
# What the scheduler-side package may import beyond itself: top files of sgl_tts that import only the standard
# library and each other.
POLICY_IMPORTS = {"sgl_tts", "sgl_tts.registry", "sgl_tts.env_names", "sgl_tts.paths"}
LAYER_OF = {package: level for level, packages in enumerate(LAYERS) for package in packages}


def package_of(module: str) -> str:
    """`sgl_tts.search.api` -> `sgl_tts.search`; `programs.rsd` -> `programs`; `sgl_tts.config` -> itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "sgl_tts" else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for module, targets in graph.items():
        packages[package_of(module)] |= {package_of(t) for t in targets} - {package_of(module)}
    return packages


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, imported module) pairs whose package is on a higher layer than the importer's."""
    return sorted((m, t) for m, targets in graph.items() for t in targets
                  if LAYER_OF[package_of(t)] > LAYER_OF[package_of(m)])


def test_every_package_has_a_layer():
    unplaced = sorted(set(package_graph(import_graph())) - set(LAYER_OF))
    assert unplaced == [], f"packages missing from LAYERS (and from docs/structure.md): {unplaced}"


def test_no_package_cycles():
    assert cycles(package_graph(import_graph())) == []


def test_imports_point_down_the_layers():
    assert upward_imports(import_graph()) == [], "a module imports a layer above it"
    from_policies = [(m, t) for m, targets in import_graph().items() if m.startswith("policies") for t in targets
                     if not t.startswith("policies") and t not in POLICY_IMPORTS]
    assert from_policies == [], "policies run inside the scheduler and import only themselves"


def test_the_layer_checks_catch_an_upward_import_and_a_package_cycle():
    graph = {"sgl_tts.search.api": {"sgl_tts.app.session"}, "sgl_tts.app.session": {"sgl_tts.search.api"}}
    assert upward_imports(graph) == [("sgl_tts.search.api", "sgl_tts.app.session")]
    assert cycles(package_graph(graph)) == [["sgl_tts.app", "sgl_tts.search"]]


def test_no_argparse_below_the_cli():
    below = sorted(str(file.relative_to(ROOT)) for module, file in modules().items()
                   if package_of(module) != "sgl_tts.cli" and "argparse" in file.read_text())
    assert below == [], "library modules hold no command-line parsing"


def test_programs_know_nothing_of_fasttts():
    forbidden = ("sgl_tts.fasttts", "sgl_tts.frontend", "sgl_tts.runtime", "policies")
    graph = import_graph()
    leaks = [(m, t) for m, targets in graph.items() if m.startswith("programs.") for t in targets
             if t.startswith(forbidden) and not (m == "programs.rsd" and t == "sgl_tts.runtime.roofline")]
    assert leaks == [], "a program imports below the search API"
