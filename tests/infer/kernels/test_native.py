"""The kernels' build: what a built package carries, and what a machine without a compiler sees (one warning with
the reason, then the torch expressions)."""

import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from runner.infer.kernels import native
from runner.infer.quant import kivi_math

ROOT = Path(__file__).parents[3]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.parametrize("compiler, reason", [
    ("/nonexistent/g++", "the C++ compiler /nonexistent/g++ cannot be run (No such file or directory)"),  # no file
    ("/bin/false", "/bin/false failed on linear_rows.cpp"),  # a compiler that fails
    (None, "no C++ compiler"),  # no $CXX and no g++ or c++ on PATH
])
def test_no_compiler_says_why_once_at_warning_level_and_keeps_the_torch_expressions(tmp_path, monkeypatch,
                                                                                     compiler, reason):
    if compiler is None:
        monkeypatch.delenv("CXX", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    else:
        monkeypatch.setenv("CXX", compiler)
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))  # a fresh cache: nothing built here yet
    monkeypatch.setattr(native, "_STATE", {})  # a process that has not tried yet
    monkeypatch.setattr(kivi_math, "_OUTLIER_OPS", [])
    records = _Records()
    logging.getLogger(native.__name__).addHandler(records)
    try:
        assert native.load() is False
        assert native.load() is False  # asked again (each kernel's loader asks): not said again
        assert kivi_math.load_outlier_ops() is False
    finally:
        logging.getLogger(native.__name__).removeHandler(records)
    warnings = [r for r in records.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert reason in warnings[0].getMessage() and "kernels unavailable" in warnings[0].getMessage()
    assert not (tmp_path / "cache" / "kernels").exists() or not any((tmp_path / "cache" / "kernels").iterdir())
    scores = torch.tensor([[3.0, 1.0, 4.0, 1.5, 5.0, 9.0, 2.0, 6.0]])  # the fallback answers (no op called)
    assert kivi_math.top_indices(scores, 3).tolist() == [[4, 5, 7]]
    assert kivi_math.lane_median(scores.T[None]).flatten().tolist() == [3.0]


@pytest.mark.slow
def test_a_built_wheel_carries_the_kernel_sources_and_loads_the_kernels_from_them(tmp_path):
    """Built and installed as a user would (non-editable), runner builds its kernels from the installed sources
    (the header included) and loads the ops, not the torch fallback."""
    if not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler on this machine: the kernels cannot be built (the fallback is tested above)")
    source = tmp_path / "source"  # a copy, so the build leaves nothing (build/, egg-info) in the checkout
    for name in ("runner", "hydra_plugins"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    offline = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, env=offline, cwd=tmp_path)
    wheel, = (tmp_path / "dist").glob("runner-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, env=offline, cwd=tmp_path)
    check = textwrap.dedent(f"""
        import logging, sys
        from pathlib import Path
        import torch
        import runner
        from runner.infer.kernels import native
        site = Path({str(tmp_path / "site")!r})
        assert Path(runner.__file__).is_relative_to(site), runner.__file__
        for path in native.SOURCES:
            assert path.is_file() and path.is_relative_to(site), path
        logging.basicConfig(level=logging.WARNING)
        assert native.load() is True, "the kernels fell back to torch"
        for op in ("linear_rows", "cache_scores", "cache_weighted", "lane_median", "top_indices"):
            assert hasattr(torch.ops.runner, op), op
        built = list(native.kernel_dir().glob("runner_kernels-*.so"))
        assert len(built) == 1, built
        print("loaded", built[0])
    """)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "RUNNER_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"loaded {tmp_path / 'cache' / 'kernels'}" in done.stdout


def _warnings_of_a_failed_load() -> list[str]:
    """native.load() is False; the warnings it logged on the way."""
    records = _Records()
    logging.getLogger(native.__name__).addHandler(records)
    try:
        assert native.load() is False
    finally:
        logging.getLogger(native.__name__).removeHandler(records)
    return [r.getMessage() for r in records.records if r.levelno >= logging.WARNING]


def test_a_cache_folder_that_cannot_hold_the_library_is_one_warning_and_nothing_compiled(tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("")  # RUNNER_CACHE is a file
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: pytest.fail("compiled what cannot be kept"))
    assert _warnings_of_a_failed_load() == [
        "runner's C++ kernels unavailable, products and attention stay torch expressions: cannot write "
        f"{tmp_path}/cache/kernels in runner's cache folder {tmp_path}/cache: {tmp_path}/cache is a file, not a "
        "folder; set RUNNER_CACHE to a writable folder"]


def test_a_cached_library_that_cannot_be_loaded_is_built_again_once(tmp_path, monkeypatch):
    bad = tmp_path / "runner_kernels-0123.so"
    built = []

    def build():
        bad.write_bytes(b"\x7fELF cut short")  # what the cache holds, each time
        built.append(bad)
        return bad

    monkeypatch.setattr(native, "build", build)
    monkeypatch.setattr(native, "_STATE", {})
    messages = _warnings_of_a_failed_load()
    assert len(built) == 2  # built again once, not in a loop
    assert messages == [
        f"the cached kernel library {bad} cannot be loaded (Could not load this library: {bad}): building it again",
        f"runner's C++ kernels unavailable, products and attention stay torch expressions: Could not load this "
        f"library: {bad}"]


def test_runner_march_x86_64_v3_is_the_avx2_set_alone(monkeypatch):
    """An AVX2-only CPU's paths on any x86 one: the flags the kernels see lose AVX-512 and AVX-VNNI, keep AVX2's."""
    if not native._compiler_macros("x86-64-v3"):
        pytest.skip("no compiler here that knows -march=x86-64-v3 (not an x86 toolchain)")
    monkeypatch.setenv("RUNNER_MARCH", "x86-64-v3")
    assert native.march() == "x86-64-v3"
    avx2_set = {"avx", "avx2", "fma", "f16c", "sse4_2"}
    assert set(native.vector_flags()) == avx2_set & native.machine_flags()
    monkeypatch.delenv("RUNNER_MARCH")
    assert set(native.vector_flags()) >= avx2_set & native.machine_flags()  # native again: the CPU's own


def test_a_march_this_cpu_cannot_run_is_one_warning_naming_what_it_lacks(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    for target in ("x86-64-v4", "sapphirerapids", "graniterapids"):  # the first this CPU cannot run
        monkeypatch.setenv("RUNNER_MARCH", target)
        if native._march_lacks():
            break
    else:
        pytest.skip(f"this CPU ({' '.join(native.vector_flags())}) runs every -march tried, or no x86 compiler")
    monkeypatch.setattr(native, "_STATE", {})
    lacks = native._march_lacks()
    assert all(flag not in native.machine_flags() for flag in lacks)
    assert _warnings_of_a_failed_load() == [
        "runner's C++ kernels unavailable, products and attention stay torch expressions: "
        f"RUNNER_MARCH={target} compiles for {', '.join(lacks)}, which this CPU lacks"]


@pytest.mark.slow
def test_the_kernel_tests_pass_on_the_avx2_paths_of_a_wider_cpu():
    """Issue 37's portability on one machine: where the CPU has AVX-512, the kernel and native-step tests run again
    on a library built for x86-64-v3 (what an AVX2-only CPU runs), in a process of their own."""
    if "avx512f" not in native.machine_flags():
        pytest.skip(f"this CPU ({' '.join(native.vector_flags())}) has no AVX-512: its own run is the AVX2 run")
    env = {**os.environ, "RUNNER_MARCH": "x86-64-v3"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           "tests/infer/kernels", "tests/infer/compiled/test_native_step.py"],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"\d+ passed", done.stdout), done.stdout[-2000:]
