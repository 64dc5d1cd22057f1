"""The layer contract, read from the source (AST): each folder imports only the folders below it.

runner/infer's folders, bottom to top, and runner's own: the bottom utilities, then the library, the torch-free
manifest front end, the steps, plan execution, the CLI. Inside runner/infer every import of runner sits at the top of
its file, so a cycle cannot come back through a function-local import either. docs/architecture.md's table lists the
same folders in the same order, with the modules each holds.
"""

import ast
import re
from pathlib import Path

import runner

RUNNER = Path(runner.__file__).parent
ROOT = RUNNER.parent
INFER_LAYERS = ["config", "kernels", "quant", "loading", "decode", "cache", "measure", "tasks", "compiled", "llamacpp",
                "select", "generation", "speculative", "serve", "server", "bench"]
RUNNER_LAYERS = ["errors", "files", "report", "infer", "manifest", "steps", "execute", "cli", "__main__"]
BOTTOM = {"errors", "files", "report"}  # import nothing of runner themselves but runner.errors


def _runner_imports(tree: ast.Module) -> list[tuple[str, int, bool]]:
    """(imported runner module, line, at the top level) for every import of runner in the file."""
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("runner"):
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("runner")]
        else:
            continue
        found += [(name, node.lineno, id(node) in top) for name in names]
    return found


def _layer(dotted: str) -> tuple[int, int] | None:
    """(runner layer, infer layer) of a dotted name under runner; None for runner itself (`__version__`)."""
    parts = dotted.split(".")[1:]
    if not parts or parts[0] not in RUNNER_LAYERS:
        return None
    if parts[0] == "infer" and len(parts) > 1 and parts[1] in INFER_LAYERS:
        return RUNNER_LAYERS.index("infer"), INFER_LAYERS.index(parts[1])
    return RUNNER_LAYERS.index(parts[0]), -1


def _modules() -> list[Path]:
    return sorted(p for p in RUNNER.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_folder_is_a_layer():
    top = {p.relative_to(RUNNER).parts[0].removesuffix(".py") for p in _modules()} - {"__init__"}
    assert top == set(RUNNER_LAYERS), f"place it in RUNNER_LAYERS: {sorted(top ^ set(RUNNER_LAYERS))}"
    infer = {p.relative_to(RUNNER / "infer").parts[0] for p in _modules() if p.is_relative_to(RUNNER / "infer")}
    infer.discard("__init__.py")
    assert infer == set(INFER_LAYERS), f"place it in INFER_LAYERS: {sorted(infer ^ set(INFER_LAYERS))}"


def test_imports_go_downward_only():
    problems = []
    for path in _modules():
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        here = _layer(dotted)
        in_infer = dotted.startswith("runner.infer.")
        for name, line, at_top in _runner_imports(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(ROOT)}:{line} imports {name}"
            if in_infer and not at_top:
                problems.append(f"{where} inside a function (imports of runner go at the top)")
            target = _layer(name)
            if here is None or target is None or dotted == "runner.infer":  # the package's lazy front door
                continue
            if in_infer and target[1] == -1 and name.split(".")[1] not in BOTTOM:
                problems.append(f"{where}: the library knows nothing of runner outside it but {sorted(BOTTOM)}")
            elif target > here:
                problems.append(f"{where}: not below it")
    assert not problems, "\n".join(problems)


def test_steps_import_no_other_step():
    """A mode's module imports no other mode's: what modes share is in steps/shared.py (the registry,
    steps/__init__.py, imports them all); a mode's own helper is `steps/<mode>_<what>.py` (serve_report.py)."""
    problems = []
    for path in sorted((RUNNER / "steps").glob("*.py")):
        if path.stem == "__init__":
            continue
        own = f"runner.steps.{path.stem}_"
        for name, line, _ in _runner_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if name.startswith("runner.steps.") and not name.startswith(("runner.steps.shared.", own)):
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not problems, "\n".join(problems)


def test_bottom_utilities_import_nothing_of_runner():
    for name in BOTTOM:
        imports = _runner_imports(ast.parse((RUNNER / f"{name}.py").read_text(encoding="utf-8")))
        imports = [i for i in imports if not i[0].startswith("runner.errors.")]  # the errors every layer raises
        assert imports == [], f"runner/{name}.py imports {imports}"


def test_the_contract_catches_an_upward_import():
    """The check itself can fail: an upward import written in a function is found, and ranked above its importer."""
    tree = ast.parse("import torch\n\ndef f():\n    from runner.infer.generation.generator import Generator\n")
    assert _runner_imports(tree) == [("runner.infer.generation.generator.Generator", 4, False)]
    assert _layer("runner.infer.generation.generator") > _layer("runner.infer.cache.layers")
    assert _layer("runner.execute.executor") > _layer("runner.steps.bench") > _layer("runner.infer.bench.cells")


def test_architecture_doc_lists_the_layers_in_order():
    """docs/architecture.md's library table: one row per folder, in this order, naming exactly its modules."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| \d+ \| `(\w+)/` \| ([^|]+) \|", text, flags=re.M)
    assert [folder for folder, _ in rows] == INFER_LAYERS
    for folder, listed in rows:
        modules = {p.relative_to(RUNNER / "infer" / folder).with_suffix("").as_posix()
                   for p in (RUNNER / "infer" / folder).rglob("*.py") if p.stem != "__init__"}
        assert set(re.findall(r"`([\w/]+)`", listed)) == modules, f"docs/architecture.md's row for {folder}/"


def test_every_import_of_runner_outside_the_package_names_something_that_exists():
    """Benchmarks, cluster scripts, plugins and tests are not type-checked: a rename must not leave them behind."""
    import importlib

    missing = []
    for folder in ("benchmarks", "cluster", "hydra_plugins", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "runner"):
                    continue
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                try:
                    module = importlib.import_module(node.module)
                except ImportError as e:
                    missing.append(f"{where}: {e}")
                    continue
                found = [a.name for a in node.names if hasattr(module, a.name)
                         or importlib.util.find_spec(f"{node.module}.{a.name}") is not None]
                missing += [f"{where}: {node.module}.{a.name}" for a in node.names if a.name not in found]
    assert not missing, "imports of names runner no longer has:\n" + "\n".join(missing)
