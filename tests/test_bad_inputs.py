"""The catalogue of malformed manifests in tests/bad_inputs/: each file says, in its header, the overrides
to pass (`# args: key=value`) and every problem line the user must see (`# expect: file:line:col: key: ...`,
`{here}` standing for the folder). Each must exit 2 with exactly those lines and no traceback. The command
lines in commands.txt (`run results`, `run compare`, argument errors) are held to the same rule. Then the
loader is fuzzed: whatever the bytes, it raises our ManifestError or nothing (tests/test_bad_files.py fuzzes
overrides and fragments)."""

import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.cli import main
from runner.errors import ManifestError
from runner.manifest.compose import load_manifest
from tests.test_cli import run_cli

HERE = Path(__file__).parent / "bad_inputs"
CASES = sorted(HERE.glob("*.yaml"))


def header(path: Path) -> tuple[list[str], list[str]]:
    """(override args, expected problem lines) from the file's leading comment lines."""
    args, expected = [], []
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        if line.startswith("# args: "):
            args.append(line.removeprefix("# args: "))
        elif line.startswith("# expect: "):
            expected.append(line.removeprefix("# expect: ").replace("{here}", str(HERE.resolve())))
        else:
            break
    return args, expected


def test_the_catalogue_covers_every_kind_of_bad_input():
    assert len(CASES) >= 40
    assert all(header(path)[1] for path in CASES), "every case states its expected error"


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_bad_manifest_gets_exactly_its_error_and_exit_2(path, monkeypatch, capsys):
    args, expected = header(path)
    monkeypatch.chdir(HERE)
    started = time.perf_counter()
    code = main(["check", path.name, *args])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.splitlines()
    assert lines[0].startswith(f"error: invalid manifest {path.name} ")  # a sweep adds "(sweep of N points; ...)"
    assert lines[0].endswith(f" ({len(expected)} problem{'s' if len(expected) > 1 else ''}):")
    assert [line.strip() for line in lines[1:]] == expected
    assert time.perf_counter() - started < 5  # alias bombs included: bounded time


@pytest.mark.parametrize("name", ["alias_bomb", "python_object_tag", "duplicate_key_nested", "missing_local_model"])
@pytest.mark.e2e
def test_the_full_run_command_refuses_them_the_same_way(name):
    path = HERE / f"{name}.yaml"
    done = run_cli(path.name, cwd=HERE, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert header(path)[1][0] in done.stderr
    assert not (HERE / "runs").exists(), "nothing runs, no run folder is made"


def command_cases() -> list[tuple[list[str], list[str]]]:
    """(argv, expected lines) for each `$ ARGS` block of commands.txt; {here} stands for the folder."""
    here, cases = str(HERE.resolve()), []
    for line in (HERE / "commands.txt").read_text(encoding="utf-8").splitlines():
        if line.startswith("$ "):
            cases.append((line[2:].replace("{here}", here).split(), []))
        elif line.strip() and not line.startswith("#"):
            cases[-1][1].append(line.strip().replace("{here}", here))
    return cases


@pytest.mark.parametrize("argv, expected", command_cases(), ids=lambda c: " ".join(c) if c and "-" not in c[0][:1]
                         else None)
def test_bad_command_lines_get_exactly_their_error_and_exit_2(argv, expected, monkeypatch, capsys):
    monkeypatch.chdir(HERE)
    before = sorted(p.name for p in HERE.iterdir())
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    err = capsys.readouterr().err.splitlines()
    first = next(i for i, line in enumerate(err) if line.startswith("error:"))
    assert code == 2 and [line.strip() for line in err[first:]] == expected
    assert sorted(p.name for p in HERE.iterdir()) == before, "nothing was created"


def test_the_command_catalogue_covers_results_compare_check_and_plan():
    cases = command_cases()
    assert len(cases) >= 15 and {argv[0] for argv, _ in cases} == {"results", "compare", "check", "plan"}


YAML_PIECES = st.sampled_from([
    "targets:", "  - name: a", "    runs:", "      - id: g", "        mode: generate", "        generate: {}",
    "version: 1", "version: 2", "seed: -1", "name: x", "name: &n x", "alias: *n", "\t- tab", "key: [", "}",
    "!!python/object:os.system", "- item", "a: b: c", "? complex", "name: x\nname: y", "&a [*a]", "%YAML 1.1",
    "---", "...", "models: {m: {id: zoo:smollm2-135m}}", "targets: []", "'quoted", "\"x\\q\"", "@", "`"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.lists(YAML_PIECES, max_size=12).map("\n".join), st.text(max_size=200)))
def test_fuzzed_manifests_raise_only_our_error(tmp_path, text):
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_manifest(path)
    except ManifestError as exc:
        assert str(exc).startswith("invalid manifest")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=120))
def test_fuzzed_bytes_raise_only_our_error(tmp_path, data):
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(data)
    try:
        load_manifest(path)
    except ManifestError:
        pass
