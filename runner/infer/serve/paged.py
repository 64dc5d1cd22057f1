"""One physical KV pool in fixed-size blocks, shared by the eager scheduler's requests (vLLM's paged KV, on CPU).

For the kinds that store each token alone (the model's dtype, fp32 / fp16 / bf16, q8_0 / q4_0 / q4_1 / nf4), every
model layer keeps one storage tensor per stored part (K and V, or their codes and scales), [H, capacity · block_size,
C]: block b holds columns [b · block_size, (b + 1) · block_size). A request's cache is a `PagedLayer` per model
layer over its block table, the list of block ids `blocks.BlockPool` gave it (the same list object: a hold appends
to it, a trim shortens it), so the blocks the scheduler counts are the blocks that hold the bytes. A prefix hit
shares the owner's full prompt blocks (their ids, reference-counted by the pool): it saves memory as well as
prefill. Capacity grows by doubling up to the pool's blocks, so the storage never exceeds the KV budget
(`capacity_blocks` ≤ BlockPool.total) and, unbounded, stays under twice the most blocks ever used.

Exact: a token's parts are what the kind's own layer (cache/layers.py) stores for it (`quantize` per token, or a
cast), read back with the same `dequantize` or cast, so attention sees the same K/V as from a request's own cache.
What it does not do: KIVI kinds (their groups and residual are per request: the scheduler gives them their own
cache, `layers.KiviLayer`) and eviction kinds; a custom attention kernel over the block table (a step gathers each
row's blocks, as the per-request caches concatenated theirs).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from runner.infer.cache.layers import STORAGE_DTYPES
from runner.infer.config.kinds import parse_kind
from runner.infer.quant.formats import dequantize, quantize


def pageable(kind: str | None) -> bool:
    """Whether `kind` (None: the model's dtype) can live in the pool: a kind that stores each token alone."""
    options = parse_kind(kind)
    return options is None or (options.family in ("float", "block") and options.eviction is None)


class PagedStore:
    """The pool's storage: per model layer, the stored parts of K and of V, in blocks of `block_size` columns."""

    def __init__(self, kind: str | None, model_dtype: torch.dtype, n_layers: int, block_size: int, total_blocks: int):
        options = parse_kind(kind)
        self.quant = options.name if options is not None and options.family == "block" else None
        self.storage_dtype = STORAGE_DTYPES[options.name] if options is not None and not self.quant else model_dtype
        self.block_size, self.total_blocks = block_size, total_blocks
        self.parts: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]  # per layer: K's parts, then V's
        self.capacity_blocks = 0

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[1,H,t,D] → the parts the kind stores for those tokens, [H,t,C] each."""
        if self.quant:
            return [p[0] for p in quantize(x, self.quant)]
        return [x[0].to(self.storage_dtype)]

    def decode(self, parts: list[torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
        """The parts of T tokens ([H,T,C] each) → [1,H,T,D] in `dtype`."""
        if self.quant:
            return dequantize(parts[0], parts[1], self.quant, dim, dtype)[None]
        return parts[0].to(dtype)[None]

    def write(self, layer: int, columns: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new K/V ([1,H,t,D]) at pool `columns` [t] of `layer`."""
        new = [*self.encode(key), *self.encode(value)]
        self._grow(layer, new, int(columns.max()) // self.block_size + 1)
        columns = columns.to(key.device)  # block tables live on the CPU
        for stored, part in zip(self.parts[layer], new):
            stored.index_copy_(1, columns, part)

    def read(self, layer: int, columns: torch.Tensor) -> list[torch.Tensor]:
        """The stored parts at pool `columns` [T] of `layer`: K's, then V's, [H,T,C] each."""
        columns = columns.to(self.parts[layer][0].device)
        return [stored.index_select(1, columns) for stored in self.parts[layer]]

    def _grow(self, layer: int, like: list[torch.Tensor], blocks: int) -> None:
        """Make room for `blocks` blocks in every layer (doubling, at most total_blocks), the first time from the
        shapes and dtypes of `like`."""
        if blocks > self.capacity_blocks:
            self.capacity_blocks = min(self.total_blocks, max(blocks, 2 * self.capacity_blocks, 4))
        columns = self.capacity_blocks * self.block_size
        if self.parts[layer] and self.parts[layer][0].shape[1] == columns:
            return
        grown = [p.new_zeros((p.shape[0], columns, p.shape[2])) for p in like]
        for old, new in zip(self.parts[layer], grown):
            new[:, :old.shape[1]] = old
        self.parts[layer] = grown

    def nbytes(self) -> int:
        """Bytes the storage really holds (all layers, the whole capacity)."""
        return sum(p.numel() * p.element_size() for parts in self.parts for p in parts)

    def cache(self, table: list[int], held: int) -> Cache:
        """A request's cache over its block `table`, its first `held` tokens already stored (a shared prefix)."""
        return Cache(layers=[PagedLayer(self, i, table, held) for i in range(len(self.parts))])


def step_columns(rows: list[PagedLayer], news: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a batched step writes and reads in the pool, the same for every model layer (computed once a step):
    the pool columns of row r's news[r] new tokens, all rows in order [Σn], and of its whole K/V right-aligned in
    `width` [B·W]. The columns left of a row's tokens read pool column 0 (finite; the step's mask gives them
    weight 0)."""
    writes, reads = [], torch.zeros((len(rows), width), dtype=torch.long)  # [B,W]
    for r, (row, n) in enumerate(zip(rows, news)):
        columns = row._columns(0, row.held + n)
        writes.append(columns[row.held:])
        reads[r, width - len(columns):] = columns
    return torch.cat(writes), reads.flatten()


def update_rows(rows: list[PagedLayer], key_states: torch.Tensor, value_states: torch.Tensor, news: list[int],
                columns: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One model layer of a batched step over requests in the pool: row r's last news[r] columns of the new
    [B,H,T,D] K/V go into its blocks; returns every row's whole K/V right-aligned, [B,H,W,D] each, gathered in one
    read. `columns`: the step's `step_columns`."""
    store, layer, t = rows[0].store, rows[0].layer, key_states.shape[-2]
    new = [(r, t - n) for r, n in enumerate(news) if n]
    keys = torch.cat([key_states[r, :, start:] for r, start in new], dim=1)[None]  # [1,H,Σn,D]
    values = torch.cat([value_states[r, :, start:] for r, start in new], dim=1)[None]
    writes, reads = columns
    store.write(layer, writes, keys, values)
    for row, n in zip(rows, news):
        row.held += n
    parts = store.read(layer, reads)  # [H,B·W,C] each
    half = len(parts) // 2

    def rows_of(side: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        whole = store.decode(side, like.shape[-1], like.dtype)[0]  # [H,B·W,D]
        return whole.unflatten(1, (len(rows), -1)).transpose(0, 1)  # [B,H,W,D]

    return rows_of(parts[:half], key_states), rows_of(parts[half:], value_states)


class PagedLayer(DynamicLayer):
    """One model layer of a request in the pool: its tokens live in the blocks of `table`, in order."""

    def __init__(self, store: PagedStore, layer: int, table: list[int], held: int = 0):
        super().__init__()
        self.store, self.layer, self.table, self.held = store, layer, table, held
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def _columns(self, start: int, stop: int) -> torch.Tensor:
        """Pool columns of this request's tokens [start, stop)."""
        size = self.store.block_size
        tokens = torch.arange(start, stop)
        blocks = torch.tensor(self.table[:-(-stop // size)], dtype=torch.long)
        return blocks[tokens // size] * size + tokens % size

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new [1,H,t,D] K/V in the request's blocks (the scheduler held them); return its whole K/V,
        [1,H,T,D] each, in the dtype they arrived in."""
        t = key_states.shape[-2]
        return update_rows([self], key_states, value_states, [t], step_columns([self], [t], self.held + t))

    def get_seq_length(self) -> int:
        return self.held

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` tokens (a negative count, as in DynamicLayer); the scheduler trims
        the block table."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove (got {tokens_to_remove})")
        self.held += tokens_to_remove

    def nbytes(self) -> int:
        """Bytes of this request's tokens in this layer (shared prefix blocks included)."""
        return sum(p.shape[0] * p.shape[2] * p.element_size() for p in self.store.parts[self.layer]) * self.held
