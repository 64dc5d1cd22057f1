"""The extra's install: the wheel cache is keyed by this CPU, the sdist pin is the one downloaded, and re-running is a
no-op once the pinned version is installed."""

import re

import pytest

from runner.infer.llamacpp import install


def test_the_wheel_cache_is_keyed_by_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    key = install.cpu_key()
    assert re.fullmatch(r"[0-9a-f]{10}", key) and install.cpu_key() == key
    assert install.wheel_folder() == tmp_path / "wheels" / f"llama_cpp_python-{install.VERSION}-{key}"
    assert install.cached_wheel() is None


def test_a_cached_wheel_is_found_there(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    folder = install.wheel_folder()
    folder.mkdir(parents=True)
    (folder / f"llama_cpp_python-{install.VERSION}-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    assert install.cached_wheel() is not None


def test_rerunning_is_a_noop_once_installed():
    if install.installed_version() != install.VERSION:
        pytest.skip(f"llama-cpp-python {install.VERSION} is not installed: make setup-llamacpp installs it")
    assert "installed already" in install.ensure_installed()


def test_runner_march_builds_llama_cpp_for_that_march_under_its_own_key(monkeypatch):
    """The same CPU set as runner's kernels (kernels.native.march): native by default; another -march with ggml's
    own x86 options off, kept apart from the native build."""
    monkeypatch.delenv("RUNNER_MARCH", raising=False)
    native_key = install.cpu_key()
    assert install._target_flags() == ["-DGGML_NATIVE=ON"]
    monkeypatch.setenv("RUNNER_MARCH", "x86-64-v3")
    assert install._target_flags() == ["-DGGML_NATIVE=OFF", "-DCMAKE_C_FLAGS=-march=x86-64-v3",
                                       "-DCMAKE_CXX_FLAGS=-march=x86-64-v3"]
    assert install.cpu_key() != native_key and re.fullmatch(r"[0-9a-f]{10}", install.cpu_key())


def test_a_cpu_with_amx_builds_llama_cpp_without_it_under_its_own_key(monkeypatch):
    """ggml's AMX product crashed llama.cpp on an AMX Xeon: where the CPU has AMX, CFLAGS and CXXFLAGS turn it off
    (cmake starts its flags from them; what was in them stays) and the wheel is cached apart; elsewhere nothing is
    added."""
    monkeypatch.delenv("RUNNER_MARCH", raising=False)
    monkeypatch.setenv("CFLAGS", "-O2")
    monkeypatch.delenv("CXXFLAGS", raising=False)
    monkeypatch.setattr(install, "machine_flags", lambda: frozenset({"avx2", "avx512f"}))
    plain_key, plain_env = install.cpu_key(), install._build_env(CMAKE_ARGS="-DGGML_NATIVE=ON")
    assert plain_env["CFLAGS"] == "-O2" and "CXXFLAGS" not in plain_env
    assert plain_env["CMAKE_ARGS"] == "-DGGML_NATIVE=ON"
    monkeypatch.setattr(install, "machine_flags", lambda: frozenset({"avx2", "avx512f", "amx_tile", "amx_int8"}))
    env = install._build_env()
    assert env["CFLAGS"] == "-O2 -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    assert env["CXXFLAGS"] == "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    monkeypatch.setattr(install, "machine_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert install.cpu_key() == plain_key
