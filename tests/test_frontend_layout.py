"""The frontend's package layout, as DESIGN.md states it: a folder per process (client/,
dispatcher/, workers/) sharing only the protocol, the op table (with its sharding rules and how
an index travels), shape inference, signal configurations and errors; no import circles; no pickle anywhere."""

import ast
import pathlib

FRONTEND = pathlib.Path(__file__).parent.parent / "paratrain" / "frontend"
PROCESSES = ("client", "dispatcher", "workers")
SHARED = ("protocol", "ops", "sharding_rules", "indexing", "shapes", "signals", "errors", "processes")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(FRONTEND.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the paratrain.frontend modules it imports (anywhere in it, functions too).
    `from package import module` counts as importing the module. (Python also runs the
    packages' own __init__ on the way: paratrain/frontend/__init__.py is GT's API.)"""
    modules = {_module_name(path) for path in FRONTEND.rglob("*.py")}
    found = {}
    for path in FRONTEND.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("paratrain.frontend"):
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    names.add(child if child in modules else node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names if alias.name.startswith("paratrain.frontend"))
        found[_module_name(path)] = {name for name in names if name in modules}
    return found


def _part(module: str) -> str:
    return module.split(".")[2] if module.count(".") >= 2 else "package"


def test_each_process_imports_only_itself_and_the_shared_modules():
    for module, imported in _imports().items():
        part = _part(module)
        if part not in PROCESSES + SHARED:
            continue  # the package itself and the command-line tools may use any part
        allowed = set(SHARED) | ({part} if part in PROCESSES else set())
        if part in SHARED:
            allowed = set(SHARED)
        wrong = sorted(name for name in imported if _part(name) not in allowed)
        assert not wrong, f"{module} imports {wrong}"


def test_the_frontend_has_no_import_circles():
    graph = _imports()
    state = {}

    def visit(module, path):
        state[module] = "open"
        for name in graph.get(module, ()):
            if name == module or name.startswith(module + "."):
                continue  # a package importing its own modules
            assert state.get(name) != "open", f"import circle: {' -> '.join(path + [name])}"
            if name not in state:
                visit(name, path + [name])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_no_module_of_the_frontend_imports_pickle_or_uses_pyobj_sockets():
    for path in FRONTEND.rglob("*.py"):
        source = path.read_text()
        tree = ast.parse(source)
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                    for alias in node.names} | {node.module for node in ast.walk(tree)
                                                 if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & {"pickle", "cPickle", "dill", "cloudpickle"}, path
        for forbidden in ("recv_pyobj", "send_pyobj", "torch.load(", "pickle.loads"):
            assert forbidden not in source, (path, forbidden)


def test_gt_worker_stays_a_function_whatever_is_imported():
    """A subpackage named like an API function would replace it on first import."""
    import importlib

    import paratrain.frontend as gt

    for path in FRONTEND.rglob("*.py"):
        importlib.import_module(_module_name(path))
    assert callable(gt.worker) and callable(gt.session) and hasattr(gt.signal, "context")


def test_the_protocols_docstring_lists_every_message():
    import paratrain.frontend.protocol as protocol
    from paratrain.frontend.protocol import messages

    classes = {cls.__name__ for cls in {*messages.TO_DISPATCHER, *messages.TO_CLIENT, *messages.TO_WORKER,
                                        *messages.TO_MONITOR}}
    table = {line.split()[0] for line in protocol.__doc__.splitlines() if " -> " in line and line.startswith("    ") and "from -> to" not in line}
    assert classes == table, (classes - table, table - classes)
