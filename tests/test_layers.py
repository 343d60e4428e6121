"""The package's structure shows its design (DESIGN.md's layers): no import cycle between any two
modules, and no import that runs back up the layers.

How it checks: every module under paratrain/ is parsed (ast, nothing imported), and each of its
`import` and `from ... import` statements is an edge to the paratrain module it names, wherever it
sits: at the top, inside a function, or under `if TYPE_CHECKING:` (a cycle of type hints is
still a cycle a reader has to untangle). `from package import name` is an edge to
package.name where that is a module, else to the package's __init__. Cycles are the graph's
strongly connected components of more than one module (Tarjan). Layers are given to modules by
the longest matching prefix in LAYERS; an edge from a lower layer to a higher one fails, and so
does one between train and frontend, which DESIGN keeps apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "paratrain"

# DESIGN.md's layers, bottom first. DESIGN draws train | frontend | plan side by side over
# parallel, and bench in the command line's row. The planner's formulas sit just below train,
# which asks them (--cp-method auto, the MoE lines of --plan-only); its command and `plan
# --validate`, which runs the training loop, sit above train. `environment` is below everything:
# every layer takes its settings from it. launch starts worlds of Groups, whose processes meet at
# stores (the mesh's row); models and data know nothing of communication. An entry with a dot
# ("plan.cli") places those modules apart from the rest of their package: the longest matching
# entry wins.
LAYERS = (
    ("environment", "errors", "cli_errors", "paths", "cli_types", "provenance", "lifetime"),  # the user errors any layer may raise,
    # how a command reports them, the command-line types that refuse bad values, where a figure came from
    ("comm",),
    ("models", "data"),
    ("mesh", "launch", "stores", "forking", "failure_report"),
    ("parallel",),
    ("plan",),
    ("train", "frontend"),
    ("plan.cli", "plan.validate", "plan.fit_cli"),
    ("bench",),
    ("cli", "env_cli", "__main__", "", "docs_check"),  # "": the package's own __init__, which re-exports;
    # docs_check runs the docs' commands as a user would, from outside the library
)
APART = {("train", "frontend"), ("frontend", "train")}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
            else:
                continue
            graph[name] |= {target for target in targets if target in known and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def part_of(module: str) -> str:
    """The first name under paratrain ("" for the package itself)."""
    return module.split(".")[1] if "." in module else ""


def layer_of(module: str) -> int:
    """The level of the longest LAYERS entry the module's name (under paratrain) starts with."""
    name = module.split(".", 1)[1] if "." in module else ""
    found = [(len(entry), level) for level, entries in enumerate(LAYERS) for entry in entries
             if entry == "" and name == "" or entry and (name == entry or name.startswith(entry + "."))]
    if not found:
        raise AssertionError(f"{module}: {part_of(module)!r} has no layer in LAYERS; give it one")
    return max(found)[1]


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_no_import_runs_back_up_the_layers():
    upward = []
    for module, targets in sorted(import_graph().items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(module) or (part_of(module), part_of(target)) in APART:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_the_checks_see_what_they_check():
    """A cycle and an upward import made up here are found: the checks are not vacuous."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "paratrain.launch" in graph["paratrain.frontend.cli"]  # imported inside a function
    assert "paratrain.comm.group" not in graph["paratrain.comm.handles"]  # the cycle issue 25 named
    assert layer_of("paratrain.train.loop") > layer_of("paratrain.comm.group")
