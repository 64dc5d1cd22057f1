"""How runner speaks: status on stderr, results on stdout, -q keeps results and warnings only, -v adds debug."""

import logging

import pytest

from runner import report


@pytest.fixture(autouse=True)
def _reset_logging():
    yield
    root = logging.getLogger("runner")
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.NOTSET)
    root.propagate = True


def _speak():
    log = logging.getLogger("runner.steps.example")
    log.debug("a detail")
    log.info("loading the model")
    log.warning("the plan file was unreadable")
    report.show("The capital of France is Paris")
    report.stream("one ")
    report.stream("two")
    report.show("")


def test_status_goes_to_stderr_and_results_to_stdout(capsys):
    report.configure(0)
    _speak()
    out, err = capsys.readouterr()
    assert out == "The capital of France is Paris\none two\n"
    assert err == "[runner] loading the model\n[runner] WARNING: the plan file was unreadable\n"


def test_quiet_keeps_results_and_warnings(capsys):
    report.configure(-1)
    _speak()
    out, err = capsys.readouterr()
    assert out == "The capital of France is Paris\none two\n"
    assert err == "[runner] WARNING: the plan file was unreadable\n"


def test_verbose_adds_debug_with_the_module(capsys):
    report.configure(1)
    _speak()
    err = capsys.readouterr().err
    assert "[runner runner.steps.example] a detail" in err and "loading the model" in err


def test_configure_twice_prints_once(capsys):
    report.configure(0)
    report.configure(0)
    report.show("once")
    assert capsys.readouterr().out == "once\n"


def test_the_default_progress_counts_and_tells_nobody(capsys):
    bar = report.no_progress("cache quality", 3, "kind")
    bar.update(note="fp16")
    bar.update(2)
    bar.set_total(4)
    bar.close()
    assert (bar.done, bar.total) == (3, 4)
    assert capsys.readouterr() == ("", "")


def test_only_the_cli_prints_or_draws_bars():
    """Libraries log; the CLI is the one printer (checked on the source, so a new print fails here)."""
    import ast
    from pathlib import Path

    import runner

    package = Path(runner.__file__).parent
    offenders = []
    for path in package.rglob("*.py"):
        if path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{path.relative_to(package)}:{node.lineno} print")
            if isinstance(node, (ast.Import, ast.ImportFrom)) and "tqdm" in ast.dump(node):
                offenders.append(f"{path.relative_to(package)}:{node.lineno} tqdm")
    assert offenders == []
