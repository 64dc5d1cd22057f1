"""Installing `engine: llama.cpp`'s extra: llama-cpp-python has no binary wheel for these machines, so its pinned
sdist is fetched (sha256-checked), built once into a wheel cached per CPU, and installed into the running venv.

The wheel is keyed by the CPU's flags because llama.cpp builds with -march=native: a wheel built on one machine
may use instructions another lacks. Re-running finds the installed version (or the cached wheel) and does nothing.
`make setup-llamacpp` runs `python -m runner.infer.llamacpp.install`. llama-bench (for benchmarks/vs_llamacpp.py)
is built from the same sdist's vendored llama.cpp and cached the same way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from runner.errors import RunnerError
from runner.files import cache_folder
from runner.infer.config.llamacpp import INSTALL_COMMAND
from runner.infer.kernels.native import machine_flags, march
from runner.infer.loading.pinned import pip_download, publish_folder, sha256_file

log = logging.getLogger(__name__)

VERSION = "0.3.36"
PACKAGE = f"llama-cpp-python=={VERSION}"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_BYTES = 76_589_250


class InstallError(RunnerError):
    """The extra could not be fetched, built or installed (pip's or cmake's own words attached)."""


def installed_version() -> str | None:
    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:
        return None


def cpu_key() -> str:
    """A short hash of what makes a -march=native build machine-specific: the architecture and the CPU's flags (and
    $RUNNER_MARCH where it is set: kernels.native.march(); the compiler flags of `_compiler_flags`)."""
    flags = " ".join(sorted(machine_flags()))
    target = "" if march() == "native" else f" {march()}"
    key = f"{os.uname().machine} {flags}{target}"
    if extra := _compiler_flags():
        key += f" {extra}"
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def _compiler_flags() -> str:
    """C and C++ flags beside -march: AMX off where the CPU has it. ggml's AMX product (built wherever -march=native
    defines __AMX_INT8__) crashed llama.cpp's first forward on a 2-core AMX Xeon (SIGSEGV in
    ggml_backend_amx_mul_mat, SmolLM2's and Qwen2.5-Coder-0.5B's GGUF files, llama-cpp-python 0.3.36); without it
    ggml takes its AVX-512 paths. An explicit -mno-amx-* wins over -march's set, in whatever order."""
    return "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if "amx_tile" in machine_flags() else ""


def _build_env(**extra: str) -> dict[str, str]:
    """The environment llama.cpp is configured in: CFLAGS and CXXFLAGS (which cmake starts its flags from) with
    `_compiler_flags` added."""
    env = {**os.environ, **extra}
    if flags := _compiler_flags():
        for name in ("CFLAGS", "CXXFLAGS"):
            env[name] = f"{env.get(name, '')} {flags}".strip()
    return env


def wheel_folder() -> Path:
    """Where this CPU's wheel is cached: ~/.cache/runner/wheels/llama_cpp_python-VERSION-CPUKEY/."""
    return cache_folder("wheels") / f"llama_cpp_python-{VERSION}-{cpu_key()}"


def cached_wheel() -> Path | None:
    wheels = sorted(wheel_folder().glob("llama_cpp_python-*.whl"))
    return wheels[0] if wheels else None


def fetch_sdist() -> Path:
    """The pinned sdist in the cache, downloaded once and verified by size and sha256 (a bad file is never kept)."""
    dest = cache_folder("sdists") / SDIST
    if dest.is_file() and dest.stat().st_size == SDIST_BYTES and sha256_file(dest) == SDIST_SHA256:
        return dest
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        pip_download([PACKAGE], Path(tmp), InstallError, PACKAGE, sdist=True)
        got = Path(tmp) / SDIST
        digest = sha256_file(got) if got.is_file() else "(missing)"
        if digest != SDIST_SHA256:
            raise InstallError(f"{SDIST}: sha256 {digest}, expected {SDIST_SHA256}; nothing was cached")
        os.replace(got, dest)
    return dest


def build_wheel(sdist: Path) -> Path:
    """`pip wheel` of the sdist (compiles llama.cpp with -march=native: minutes), published into the cache."""
    target = wheel_folder()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".building-") as tmp:
        log.info("building llama-cpp-python %s for this CPU (once; compiles llama.cpp, minutes)", VERSION)
        cmake_args = " ".join([os.environ.get("CMAKE_ARGS", ""), *_target_flags()]).strip()
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-w", tmp,
              str(sdist)], "pip wheel", env=_build_env(CMAKE_ARGS=cmake_args))
        built = Path(tmp) / "out"
        built.mkdir()
        for wheel in Path(tmp).glob("llama_cpp_python-*.whl"):
            shutil.move(str(wheel), built / wheel.name)
        publish_folder(built, target, next(built.glob("*.whl")).name)
    found = cached_wheel()
    assert found is not None
    return found


def ensure_installed() -> str:
    """Install the pinned extra into this venv, with its `server` extra (`python -m llama_cpp.server`, a serve
    block's endpoint), unless both are there; → what was done, in words."""
    if installed_version() == VERSION and _has_server():
        return f"llama-cpp-python {VERSION} is installed already"
    wheel = cached_wheel() or build_wheel(fetch_sdist())
    _run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", f"{wheel}[server]"],
         "pip install")
    return f"installed {wheel.name} (cached in {wheel.parent})"


def _has_server() -> bool:
    try:
        version("sse-starlette"), version("starlette-context"), version("pydantic-settings")
    except PackageNotFoundError:
        return False
    return True


def llama_tool(name: str = "llama-bench") -> Path:
    """One of llama.cpp's tools (llama-bench, llama-batched-bench, llama-perplexity) built from the sdist's vendored
    source (cmake --target NAME), cached per CPU in <cache>/NAME/<version>-<cpu key>/."""
    target = cache_folder(name) / f"{VERSION}-{cpu_key()}"
    binary = target / name
    if binary.is_file():
        return binary
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".building-") as tmp:
        with tarfile.open(fetch_sdist()) as tar:
            tar.extractall(tmp, filter="data")
        source = Path(tmp) / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
        build = Path(tmp) / "build"
        log.info("building %s from llama.cpp vendored in %s (once; minutes)", name, SDIST)
        _run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
              "-DBUILD_SHARED_LIBS=OFF", *_target_flags()], "cmake", env=_build_env())
        _run(["cmake", "--build", str(build), "--target", name, "-j", str(os.cpu_count() or 1)], "cmake --build")
        out = Path(tmp) / "out"
        out.mkdir()
        shutil.copy2(build / "bin" / name, out / name)
        publish_folder(out, target, name)
    return binary


def _target_flags() -> list[str]:
    """cmake's flags for the CPU to build for: native, or $RUNNER_MARCH's -march as runner's kernels (ggml's x86
    options then default to AVX2's family, and the compiler's -march decides the rest)."""
    if march() == "native":
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF", f"-DCMAKE_C_FLAGS=-march={march()}", f"-DCMAKE_CXX_FLAGS=-march={march()}"]


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise InstallError(f"{what} failed ({INSTALL_COMMAND}): {(done.stderr or done.stdout).strip()[-2000:]}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[runner] %(message)s")
    try:
        log.info(ensure_installed())
    except RunnerError as exc:
        log.error("%s", exc)
        sys.exit(2)
