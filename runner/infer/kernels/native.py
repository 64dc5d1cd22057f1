"""runner's C++ kernels (a few-row product, attention over a cache in its stored format, the two selections of
KIVI's outliers), built once per machine with the system's compiler into one library of torch ops, and loaded.

    load() → True once torch.ops.runner.{linear_rows, cache_scores, cache_weighted, lane_median, top_indices,
             gguf_rows, gguf_dequantize, gguf_paths, argmax_rows} exist in this process
    loaded() → whether load() has succeeded in this process (builds nothing)

The library goes to <cache folder>/kernels/runner_kernels-<hash>.so (runner.files.cache_dir: $RUNNER_CACHE or
~/.cache/runner); the hash covers the sources, the flags, the compiler, this CPU (-march=native: a home directory
shared by other CPUs gets one build each) and torch's version (the ops are built against its headers, as
torch.utils.cpp_extension would). A cached library that cannot be loaded is built again, once.
$RUNNER_MARCH compiles for another -march than native (march()): x86-64-v3 is an AVX2-only CPU's set (AVX2, FMA,
F16C), so an AVX-512 machine runs and times the paths an AVX2-only one would; cpu_flags() then says what the build
has, and llama.cpp's tools are built for the same set (llamacpp.install).
No compiler, a failed build or a cache folder that cannot hold the library: load() is False, said once at warning
level with the reason, and callers keep their torch expressions.
Owns: compiling, caching and loading. Knows nothing of what the kernels do (cpu_linear.py, cpu_attention.py,
gguf_rows.py and kvcodes.py do).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from runner.errors import CacheError
from runner.files import cache_dir, cache_folder, cache_write

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = tuple(HERE / "csrc" / name for name in (  # headers hashed, .cpp compiled
    "linear_rows.cpp", "attention_ops.cpp", "decode_attention.cpp", "outlier_ops.cpp", "gguf_rows.cpp",
    "gguf_kquants.cpp", "gguf_interleaved.cpp", "argmax_rows.cpp", "llama_step.cpp", "decode_attention.h",
    "gguf_blocks.h", "prefetch.h"))
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++20")  # and -march=march()
_STATE: dict[str, bool] = {}


def march() -> str:
    """What the kernels are compiled for: $RUNNER_MARCH (a gcc -march value, e.g. x86-64-v3), else native."""
    return os.environ.get("RUNNER_MARCH") or "native"


def kernel_dir() -> Path:
    """Where built libraries are kept: the cache folder's kernels/ (read at each call: $RUNNER_CACHE may change)."""
    return cache_dir() / "kernels"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernels see them: /proc/cpuinfo's (avx2, fma, f16c, avx512f, avx512_bf16,
    amx_tile, ...; empty where there is no such file), less the vector flags march() does not compile for."""
    return _flags_for(march())


@functools.cache
def machine_flags() -> frozenset[str]:
    """The CPU's own feature flags from /proc/cpuinfo; empty where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def _is_vector(flag: str) -> bool:
    return flag.startswith(("avx", "amx")) or flag in ("sse4_2", "fma", "f16c", "neon", "asimd", "sve")


def vector_flags() -> list[str]:
    """The flags that choose a kernel path (what a benchmark figure or a CI log says it ran on)."""
    return sorted(f for f in cpu_flags() if _is_vector(f))


@functools.cache
def _flags_for(target: str) -> frozenset[str]:
    """machine_flags(), less the vector flags whose macro (avx512_bf16 → __AVX512BF16__, sse4_2 → __SSE4_2__) the
    compiler does not define for -march=target."""
    flags = machine_flags()
    if target == "native":
        return flags
    macros = _compiler_macros(target)
    return frozenset(f for f in flags if not _is_vector(f) or _macros_of(f) & macros)


@functools.cache
def _compiler_macros(target: str) -> frozenset[str]:
    """The macros the compiler predefines for -march=target (empty without a compiler that knows it)."""
    try:
        done = subprocess.run([_compiler() or "c++", f"-march={target}", "-dM", "-E", "-x", "c++", os.devnull],
                              capture_output=True, text=True)
    except OSError:
        return frozenset()
    return frozenset(line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define "))


def _march_lacks() -> list[str]:
    """The vector flags -march=march() compiles for that this CPU lacks (its library would fault)."""
    if march() == "native":
        return []
    macros = _compiler_macros(march())
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
              "avx512_vnni", "avx_vnni", "amx_tile")
    return [f for f in wanted if _macros_of(f) & macros and f not in machine_flags()]


def _macros_of(flag: str) -> set[str]:
    """The macro a compiler defines for a CPU flag: avx512_bf16 → __AVX512BF16__, sse4_2 → __SSE4_2__."""
    return {f"__{flag.upper()}__", f"__{flag.upper().replace('_', '')}__"}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _machine() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        return "\n".join(sorted({line for line in info.splitlines() if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _torch_flags() -> list[str]:
    """Compile and link flags for sources that include torch's headers."""
    from torch.utils import cpp_extension

    library_dir = Path(torch.__file__).parent / "lib"
    return [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{path}" for path in cpp_extension.include_paths()),
            f"-L{library_dir}", f"-Wl,-rpath,{library_dir}", "-lc10", "-ltorch_cpu"]


def build(sources: tuple[Path, ...] = SOURCES, name: str = "runner_kernels") -> Path:
    """The shared library of `sources`, compiled now unless this machine already has it."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or $CXX) found")
    flags = [*FLAGS, f"-march={march()}", *_torch_flags()]
    digest = hashlib.sha256(b"\0".join([*(s.read_bytes() for s in sources), " ".join(flags).encode(),
                                        compiler.encode(), _machine().encode(), torch.__version__.encode()]))
    target = kernel_dir() / f"{name}-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    cache_folder("kernels")  # CacheError before compiling when the library could not be kept
    lacks = _march_lacks()
    if lacks:
        raise RuntimeError(f"RUNNER_MARCH={march()} compiles for {', '.join(lacks)}, which this CPU lacks")
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(tmp) / f"{name}.so"
        compiled = [str(s) for s in sources if s.suffix == ".cpp"]
        try:
            run = subprocess.run([compiler, *compiled, "-o", str(built), *flags], capture_output=True, text=True)
        except OSError as error:  # $CXX names no file, or one that cannot be run
            raise RuntimeError(f"the C++ compiler {compiler} cannot be run ({error.strerror or error})") from error
        if run.returncode:
            raise RuntimeError(f"{compiler} failed on {', '.join(s.name for s in sources)}:\n{run.stderr[-2000:]}")
        cache_write(target, built.read_bytes())
    log.info("built %s", target)
    return target


def load() -> bool:
    """Build (first time on this machine) and load the ops; False when they cannot be (logged once)."""
    if "loaded" not in _STATE:
        try:
            _load_built()
            _STATE["loaded"] = True
        except (OSError, RuntimeError, CacheError) as error:
            _STATE["loaded"] = False
            log.warning("runner's C++ kernels unavailable, products and attention stay torch expressions: %s", error)
    return _STATE["loaded"]


def loaded() -> bool:
    """Whether the ops are loaded in this process, without building or loading them (for callers that gain from
    the kernels but should not be the ones to build them: greedy decoding's argmax)."""
    return _STATE.get("loaded", False)


def _load_built() -> None:
    """Load the built library; one the cache holds that cannot be loaded (cut short, not a library) is built again,
    once."""
    path = build()
    try:
        torch.ops.load_library(str(path))
    except OSError as error:
        log.warning("the cached kernel library %s cannot be loaded (%s): building it again", path, error)
        path.unlink(missing_ok=True)
        torch.ops.load_library(str(build()))
