"""`run check` of a manifest on engine llama.cpp where the extra is not installed: a located error naming the command
that installs it, exit 2. RUNNER_LLAMACPP_ABSENT makes any machine judge as one without the extra, so this passes
whether or not llama-cpp-python is installed here."""

from runner.cli import main
from runner.infer.config.llamacpp import ABSENT_ENV, INSTALL_COMMAND

MANIFEST = """targets:
  - name: smol
    runs:
      - id: g
        mode: generate
        generate: {engine: llama.cpp, cache_kind: q8_0}
      - id: b
        mode: bench
        bench: {engines: [eager, llama.cpp]}
"""


def test_check_says_how_to_install_the_extra(tmp_path, monkeypatch, capsys):
    (tmp_path / "m.yaml").write_text(MANIFEST)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ABSENT_ENV, "1")
    assert main(["check", "m.yaml"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("(2 problems):")
    assert lines[1].strip().startswith("m.yaml:6:20: targets[0].runs[0].generate.engine: engine: llama.cpp needs")
    assert lines[2].strip().startswith("m.yaml:9:17: targets[0].runs[1].bench.engines: engine: llama.cpp needs")
    assert all(f"run `{INSTALL_COMMAND}`" in line for line in lines[1:])
    assert "Traceback" not in "\n".join(lines)
