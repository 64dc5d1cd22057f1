"""KV memory in fixed-size blocks, for every cache kind: what a block costs, how many a request holds, the pool.

A block is `block_size` tokens of one request at the kind's compressed rate (`registry.bytes_per_token`). A request
holding n tokens holds ceil(n / block_size) blocks plus `reserve` blocks: what the kind keeps beside its compressed
tokens, at its worst over n (KIVI: up to residual_len − 1 newest tokens in full precision, the sinks, the codebooks;
0 for every per-token kind). So `blocks × block_bytes` bounds the bytes the requests really hold (`cache_bytes`),
whatever their lengths: a budget in bytes becomes floor(bytes / block_bytes) blocks.
Blocks are counted, not placed: each request's cache is its own (serve/rows.py), so there is no physical pool to
fragment and nothing shared between requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from runner.infer.cache.registry import bytes_per_token, estimate_cache_bytes
from runner.infer.config.kinds import parse_kind


@dataclass(frozen=True)
class BlockSpec:
    """What a block is for one model and cache kind."""

    block_size: int  # tokens per block
    block_bytes: int  # bytes of block_size compressed tokens, all layers, K and V
    reserve: int  # blocks each request holds beside its tokens' (KIVI's full-precision residual, sinks)

    def blocks_for(self, tokens: int) -> int:
        """Blocks a request holding `tokens` tokens needs."""
        return -(-tokens // self.block_size) + self.reserve if tokens > 0 else 0


def block_spec(config, kind: str | None, block_size: int, model_dtype: torch.dtype) -> BlockSpec:
    """The BlockSpec of `kind` for a model `config`: the reserve is the most, over every length, that the kind's
    estimated bytes exceed ceil(n / block_size) blocks (the pattern repeats every lcm(residual_len, block_size))."""
    block_bytes = math.ceil(bytes_per_token(config, kind, model_dtype) * block_size)
    options = parse_kind(kind)
    period, sinks = block_size, 0
    if options is not None and options.family == "kivi":
        period, sinks = math.lcm(options.kivi.residual_len, block_size), options.sinks
    over = max(estimate_cache_bytes(config, kind, 1, n, model_dtype) - -(-n // block_size) * block_bytes
               for n in range(1, sinks + 2 * period + 1))
    return BlockSpec(block_size, block_bytes, max(0, -(-over // block_bytes)))


def blocks_in(budget_bytes: int, spec: BlockSpec) -> int:
    """The blocks a KV budget of `budget_bytes` holds."""
    return budget_bytes // spec.block_bytes


@dataclass
class BlockPool:
    """`total` blocks and who holds how many. `hold` grows a holding or says it cannot; nothing blocks or waits."""

    spec: BlockSpec
    total: int
    held: dict[int, int] = field(default_factory=dict)  # request id → blocks
    used: int = 0

    @property
    def free(self) -> int:
        return self.total - self.used

    def shortfall(self, rid: int, tokens: int) -> int:
        """Blocks missing for request `rid` to hold `tokens` tokens (0: it fits)."""
        return max(0, self.spec.blocks_for(tokens) - self.held.get(rid, 0) - self.free)

    def hold(self, rid: int, tokens: int) -> bool:
        """Grow `rid`'s holding to cover `tokens` tokens; False (and nothing changed) if the blocks are not free."""
        more = self.spec.blocks_for(tokens) - self.held.get(rid, 0)
        if more > self.free:
            return False
        if more > 0:
            self.held[rid] = self.held.get(rid, 0) + more
            self.used += more
        return True

    def trim(self, rid: int, tokens: int) -> None:
        """Shrink `rid`'s holding to what `tokens` tokens need (a rejected draft's blocks back to the pool)."""
        if rid in self.held:
            keep = min(self.held[rid], self.spec.blocks_for(tokens))
            self.used -= self.held[rid] - keep
            self.held[rid] = keep

    def release(self, rid: int) -> None:
        self.used -= self.held.pop(rid, 0)
