"""heap.keep(): a layer's freed activations are reused, not faulted back in; release() gives them back. Each case in
a fresh interpreter, since both change the process's allocator for good. heap.onto_huge_pages(): a model's weights
moved onto a mapping advised for huge pages, every value, view and tie as it was; a static KV cache's tensors too."""

import json
import os
import subprocess
import sys

import pytest
import torch

from runner.infer.cache.static.cache import make_static_cache
from runner.infer.kernels import heap
from runner.infer.loading.models import load_model
from tests.conftest import TINY_LLAMA

glibc = pytest.mark.skipif(heap._glibc() is None, reason="malloc is not glibc's here")
WIDE_LLAMA = {**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 1024}  # 8 MiB of float32 weights
huge_pages = pytest.mark.skipif(not heap.huge_pages_allowed(),
                                reason="this kernel has no transparent huge pages, or they are turned off")

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


@glibc
def test_kept_heap_reuses_a_layers_activations_where_glibc_alone_faults_them_back_in():
    default, kept = _run("default"), _run("keep")
    assert not default["kept"] and kept["kept"]
    assert default["fault_mib"] > 8 * 40  # the pattern this guards against: each layer faulted back in
    assert kept["fault_mib"] < 8  # kept: nothing but stray pages


@glibc
def test_release_gives_the_kept_memory_back():
    kept = _run("keep")
    assert kept["held_mib"] - kept["released_mib"] > 50  # the three freed blocks, held until release()


@glibc
def test_a_process_with_its_own_malloc_settings_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    monkeypatch.setattr(heap, "_STATE", {})
    assert heap.keep() is False


@glibc
def test_loading_a_model_on_cpu_keeps_the_heap(monkeypatch):
    for name in heap.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(heap, "_STATE", {})
    load_model(config=TINY_LLAMA, device="cpu")
    assert heap._STATE == {"kept": True}


def _advised(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding `tensor`'s first byte is advised for huge pages (smaps' VmFlags `hg`)."""
    return "hg" in heap.mapping_of(tensor.data_ptr()).get("VmFlags", "").split()


@huge_pages
def test_a_models_weights_move_onto_huge_pages_with_their_values_views_and_ties():
    model = load_model(config={**WIDE_LLAMA, "tie_word_embeddings": True}, device="cpu").model
    module = torch.nn.Module()  # a buffer that is a view of a parameter: they stay one storage
    module.weight = torch.nn.Parameter(torch.randn(64, 48))
    module.register_buffer("columns", module.weight.data.t()[5:9])
    model.add_module("extra", module)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    ids = torch.randint(0, 258, (2, 7))
    with torch.no_grad():
        logits = model(ids).logits
        placed = heap.onto_huge_pages(model)
        again = model(ids).logits
    assert placed >= sum(p.numel() * p.element_size() for p in model.parameters())  # tied and viewed: once
    assert torch.equal(logits, again)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
        assert _advised(tensor), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert module.columns.untyped_storage().data_ptr() == module.weight.untyped_storage().data_ptr()
    assert module.columns.stride() == (1, 48)
    assert module.columns.storage_offset() - module.weight.storage_offset() == 5
    module.weight.data[0, 5] = 7.0  # still a view
    assert module.columns[0, 0].item() == 7.0


@huge_pages
def test_loading_a_model_on_cpu_puts_its_weights_on_huge_pages_and_a_small_one_stays_where_it_is():
    model = load_model(config=WIDE_LLAMA, device="cpu").model
    assert all(_advised(p) for p in model.parameters())
    heap.onto_huge_pages(model, huge=False)  # a benchmark's baseline: 4 KiB pages (VmFlags nh)
    assert not any(_advised(p) for p in model.parameters())
    assert all("nh" in heap.mapping_of(p.data_ptr())["VmFlags"].split() for p in model.parameters())
    small = torch.nn.Linear(8, 8)  # less than a huge page: nothing to gain, left where it is
    address = small.weight.data_ptr()
    assert heap.onto_huge_pages(small) == 0 and small.weight.data_ptr() == address


@huge_pages
@pytest.mark.parametrize("kind", [None, "q8_0", "kivi4:g8:r16"])
def test_a_static_kv_cache_on_cpu_lies_on_huge_pages_and_is_written_and_read_as_one_left_in_place(kind, monkeypatch):
    """4 rows × 8,192 columns of the tiny llama's K/V (16 MiB in float32, 5 in kivi4) move onto huge pages; writing
    the same columns into it and into a cache left where torch allocated it gives the same K/V back and the same
    stored tensors (no attribute of a layer still views the old copy). Where torch's memory lies is not asserted: in
    a long test process it was once in a mapping advised for huge pages too (cause not found)."""
    model = load_model(config=TINY_LLAMA, device="cpu").model
    cache = make_static_cache(kind, model, 4, 8192)
    with monkeypatch.context() as patched:
        patched.setattr(heap, "layers_onto_huge_pages", lambda layers: 0)
        left = make_static_cache(kind, model, 4, 8192)
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(4, 2, 24, 16, generator=g) for _ in range(2))  # [B,Hkv,T,D]
    for c in (cache, left):
        c.columns, c.end = torch.arange(24), torch.tensor(24)
    for layer, (ours, theirs) in enumerate(zip(cache.static_layers, left.static_layers)):
        for got, expected in zip(cache.update(keys, values, layer), left.update(keys, values, layer)):
            assert got is None and expected is None or torch.equal(got, expected)
        for name in ours.TENSORS:
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
            if getattr(ours, name).numel():  # KIVI without sinks holds none: nothing to move
                assert _advised(getattr(ours, name)), name
