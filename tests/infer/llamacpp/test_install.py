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
