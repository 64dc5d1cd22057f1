"""The layer contract of runner.infer: each module imports only modules of layers below it (or earlier in its own
layer), at the top of the file, and nothing of runner outside the library but its bottom utilities.

Read from the source (AST), so a cycle cannot come back through a function-local import either.
"""

import ast
from pathlib import Path

import runner.infer

INFER = Path(runner.infer.__file__).parent
# Bottom to top; within a layer, a module may import the ones listed before it.
LAYERS = [
    ("config", ["config", "quant", "native", "kvcodes", "cpu_attention", "cpu_linear"]),
    ("loading", ["pinned", "zoo", "data", "weights", "models"]),
    ("forward", ["forward", "attention"]),
    ("caches", ["codebooks", "kivicodec", "kvcache", "window", "static_plain", "static_kivi", "static", "ragged"]),
    ("strategies", ["sampling", "beam", "contrastive", "spec_rounds"]),
    ("measure", ["timing", "static_state", "compiled", "speed", "quality"]),  # compiled: the engine speed.py times on
    ("select", ["cache_plans", "autocache", "jointselect"]),
    ("generators", ["generator", "spec_text", "spec_batch", "speculative"]),
    ("bench cells", ["cells"]),
]
ORDER = [module for _, modules in LAYERS for module in modules]
ALLOWED_OUTSIDE = {"runner", "runner.errors", "runner.files", "runner.report"}  # import nothing of runner themselves


def _runner_imports(tree: ast.Module) -> list[tuple[str, int, bool]]:
    """(imported runner module, line, at the top level) for every import of runner in the file."""
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("runner"):
            names = [f"{node.module}.{a.name}" if node.module == "runner.infer" else node.module for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("runner")]
        else:
            continue
        found += [(name, node.lineno, id(node) in top) for name in names]
    return found


def test_every_module_is_in_a_layer():
    modules = {p.stem for p in INFER.glob("*.py")} - {"__init__"}
    assert modules == set(ORDER), f"place new modules in LAYERS: {sorted(modules ^ set(ORDER))}"


def test_imports_go_downward_only_and_sit_at_the_top():
    problems = []
    for module in ORDER:
        path = INFER / f"{module}.py"
        for name, line, at_top in _runner_imports(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"runner/infer/{module}.py:{line} imports {name}"
            if not at_top:
                problems.append(f"{where} inside a function (imports of runner go at the top)")
            if name.startswith("runner.infer."):
                target = name.removeprefix("runner.infer.").split(".")[0]
                if ORDER.index(target) >= ORDER.index(module):
                    problems.append(f"{where}: not below it")
            elif name not in ALLOWED_OUTSIDE:
                problems.append(f"{where}: the library knows nothing of runner outside it")
    assert not problems, "\n".join(problems)


def test_the_contract_catches_an_upward_import(tmp_path):
    """The check itself can fail: an upward import written in a function is found."""
    tree = ast.parse("import torch\n\ndef f():\n    from runner.infer.generator import Generator\n")
    assert _runner_imports(tree) == [("runner.infer.generator", 4, False)]


def test_bottom_utilities_import_nothing_of_runner():
    root = INFER.parent
    for name in ("errors", "files", "report"):
        imports = _runner_imports(ast.parse((root / f"{name}.py").read_text(encoding="utf-8")))
        assert imports == [], f"runner/{name}.py imports {imports}"
