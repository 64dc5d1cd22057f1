"""heap.keep(): a layer's freed activations are reused, not faulted back in; release() gives them back. Each case in
a fresh interpreter, since both change the process's allocator for good."""

import json
import os
import subprocess
import sys

import pytest

from runner.infer.kernels import heap
from runner.infer.loading.models import load_model
from tests.conftest import TINY_LLAMA

pytestmark = pytest.mark.skipif(heap._glibc() is None, reason="malloc is not glibc's here")

# A layer's pattern on glibc's malloc itself (no other allocation in between): three 20 MiB activations live
# together, every page written, then freed: 60 MiB at the heap's top, above the trim threshold glibc sets itself after
# the first frees (40 MiB). Six layers to settle, then the pages faulted in over eight more, and RSS, in MiB.
LAYERS = """
import ctypes, json, resource, sys
from runner.infer.kernels import heap
kept = heap.keep() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
BLOCK = 20 * 2**20
def rss_mib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) / 1024
def layer():
    blocks = [libc.malloc(BLOCK) for _ in range(3)]
    for b in blocks:
        ctypes.memset(b, 1, BLOCK)
    for b in blocks:
        libc.free(b)
for _ in range(6):
    layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    layer()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
held = rss_mib()
heap.release()
print(json.dumps({"kept": kept, "fault_mib": faults * 4 / 1024, "held_mib": held, "released_mib": rss_mib()}))
"""


def _run(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in heap.USER_SETTINGS}
    out = subprocess.run([sys.executable, "-c", LAYERS, mode], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kept_heap_reuses_a_layers_activations_where_glibc_alone_faults_them_back_in():
    default, kept = _run("default"), _run("keep")
    assert not default["kept"] and kept["kept"]
    assert default["fault_mib"] > 8 * 40  # the pattern this guards against: each layer faulted back in
    assert kept["fault_mib"] < 8  # kept: nothing but stray pages


def test_release_gives_the_kept_memory_back():
    kept = _run("keep")
    assert kept["held_mib"] - kept["released_mib"] > 50  # the three freed blocks, held until release()


def test_a_process_with_its_own_malloc_settings_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    monkeypatch.setattr(heap, "_STATE", {})
    assert heap.keep() is False


def test_loading_a_model_on_cpu_keeps_the_heap(monkeypatch):
    for name in heap.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(heap, "_STATE", {})
    load_model(config=TINY_LLAMA, device="cpu")
    assert heap._STATE == {"kept": True}
