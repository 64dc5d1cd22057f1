"""KV memory in fixed-size blocks, for every cache kind: what a block costs, how many a request holds, the pool.

A block is `block_size` tokens of one request at the kind's compressed rate (`registry.bytes_per_token`). A request
holding n tokens holds ceil(n / block_size) blocks plus `reserve` blocks: what the kind keeps beside its compressed
tokens, at its worst over n (KIVI: up to residual_len − 1 newest tokens in full precision, the sinks, the codebooks;
0 for every per-token kind). So `blocks × block_bytes` bounds the bytes the requests really hold (`cache_bytes`),
whatever their lengths: a budget in bytes becomes floor(bytes / block_bytes) blocks.
Blocks have ids: each holder (a request, or a retained prompt prefix) holds a table of them, and a block may be in
several tables (a shared prompt prefix: reference-counted, used once). For the kinds that store each token alone,
serve/paged.py keeps the bytes in those blocks; for KIVI, whose groups and residual are per request, the ids are
only counted (each request's cache is its own, serve/rows.py).
"""

from __future__ import annotations

import heapq
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
    """`total` blocks and who holds which. `hold` grows a holding or says it cannot; nothing blocks or waits. Ids
    are handed out lowest first (a freed one again before a new one), so the largest id stays below the most
    blocks ever used at once."""

    spec: BlockSpec
    total: int
    tables: dict[int, list[int]] = field(default_factory=dict)  # holder id → its block ids, in token order
    refs: dict[int, int] = field(default_factory=dict)  # block id → how many tables hold it
    _freed: list[int] = field(default_factory=list)
    _next: int = 0

    @property
    def used(self) -> int:
        return len(self.refs)

    @property
    def free(self) -> int:
        return self.total - self.used

    @property
    def held(self) -> dict[int, int]:
        """Holder id → blocks in its table."""
        return {rid: len(table) for rid, table in self.tables.items()}

    def hold(self, rid: int, tokens: int) -> bool:
        """Grow `rid`'s table to cover `tokens` tokens with new blocks; False (and nothing changed) if they are not
        free."""
        table = self.tables.setdefault(rid, [])
        more = self.spec.blocks_for(tokens) - len(table)
        if more > self.free:
            if not table:
                del self.tables[rid]
            return False
        for _ in range(more):
            table.append(self._take())
        return True

    def share(self, rid: int, holder: int, blocks: int) -> None:
        """Start `rid`'s table with the first `blocks` blocks of `holder`'s (a shared prefix: no new block)."""
        assert not self.tables.get(rid), "a table starts with its shared prefix"
        shared = self.tables[holder][:blocks]
        for block in shared:
            self.refs[block] += 1
        self.tables[rid] = list(shared)

    def trim(self, rid: int, tokens: int) -> None:
        """Shrink `rid`'s table to what `tokens` tokens need (a rejected draft's blocks back to the pool), in place."""
        table = self.tables.get(rid)
        if table is not None:
            keep = min(len(table), self.spec.blocks_for(tokens))
            self._drop(table[keep:])
            del table[keep:]

    def release(self, rid: int) -> None:
        self._drop(self.tables.pop(rid, []))

    def _take(self) -> int:
        if self._freed:
            block = heapq.heappop(self._freed)
        else:
            block, self._next = self._next, self._next + 1
        self.refs[block] = 1
        return block

    def _drop(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if not self.refs[block]:
                del self.refs[block]
                heapq.heappush(self._freed, block)
