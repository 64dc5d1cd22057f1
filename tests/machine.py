"""What this machine's CPU is, asked of the machine (never assumed): tests that depend on a vector width derive it
here, and kernel tests say which of their paths this CPU does not have."""

from __future__ import annotations

import platform
from pathlib import Path

from runner.infer.kernels.native import cpu_flags  # the tests see the CPU as the kernels do


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    line = next((line for line in text.splitlines() if line.startswith("model name")), "")
    return line.partition(":")[2].strip() or platform.machine()


def missing(*flags: str) -> str:
    """'' when this CPU has all of `flags`, else a skip reason naming the absent ones and the CPU."""
    absent = [flag for flag in flags if flag not in cpu_flags()]
    return f"this CPU ({cpu_model()}) lacks {', '.join(absent)}" if absent else ""


def aten_int4_row_block() -> int | None:
    """Rows aten's CPU int4 packing (_convert_weight_to_int4pack_for_cpu) interleaves: its BLOCK_N follows the vector
    width aten dispatches to (aten/src/ATen/native/cpu/int4mm_kernel.cpp: 64 under AVX-512, 32 under AVX2), which
    torch reports; None for another capability (no fact to check against)."""
    import torch

    return {"AVX512": 64, "AVX2": 32}.get(torch.backends.cpu.get_cpu_capability())
