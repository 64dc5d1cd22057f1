"""C++ sources of runner's CPU kernels, built once per machine with the system's compiler.

    build(source, torch_headers=False) → path of the shared library under ~/.cache/runner/kernels/<name>-<hash>.so

The hash covers the source, the flags, the compiler and this CPU (-march=native: a home directory shared by other
CPUs gets one build each), and with torch_headers torch's version, so a changed source or another torch builds anew.
A source with torch_headers registers torch ops (TORCH_LIBRARY) and is loaded with torch.ops.load_library; one without
is plain C, loaded with ctypes. Raises RuntimeError when there is no compiler or the build fails; callers fall back.
Owns: compiling and caching. Knows nothing of what the kernels do.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from runner.files import atomic_write

log = logging.getLogger(__name__)

KERNEL_DIR = Path.home() / ".cache" / "runner" / "kernels"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def _machine() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        return "\n".join(sorted({line for line in info.splitlines() if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _torch_flags() -> list[str]:
    """Compile and link flags for a source that includes torch's headers (as torch.utils.cpp_extension would)."""
    from torch.utils import cpp_extension

    library_dir = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in cpp_extension.include_paths()),
            f"-L{library_dir}", f"-Wl,-rpath,{library_dir}", "-lc10", "-ltorch_cpu"]


def build(source: Path, torch_headers: bool = False) -> Path:
    """The shared library of `source`, compiled now unless this machine already has it."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or $CXX) found")
    flags = [*FLAGS, *(_torch_flags() if torch_headers else ["-std=c++17"])]
    digest = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(flags).encode(), compiler.encode(),
                                        _machine().encode(), torch.__version__.encode()])).hexdigest()[:16]
    target = KERNEL_DIR / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(tmp) / f"{source.stem}.so"
        run = subprocess.run([compiler, str(source), "-o", str(built), *flags], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"{compiler} failed on {source.name}:\n{run.stderr[-2000:]}")
        atomic_write(target, built.read_bytes())
    log.info("built %s", target)
    return target
