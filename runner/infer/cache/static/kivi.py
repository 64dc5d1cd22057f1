"""The static KIVI layout for the compiled engine: sinks, the quantized region and a ring of full-precision
columns, all preallocated, written in place by column with fixed shapes (layouts: static/cache.py's docstring).
Owns: StaticKiviLayer.
"""

from __future__ import annotations

import torch

from runner.infer.cache.kivi_codec import KiviCodec
from runner.infer.cache.static.plain import StaticPlainLayer
from runner.infer.config.kinds import KindOptions
from runner.infer.kernels import cpu_attention
from runner.infer.quant.formats import plane_bytes


class StaticKiviLayer(KiviCodec, StaticPlainLayer):
    """KIVI over fixed shapes (see the module docstring): the sinks, then the quantized region and the ring.

    Invariant between writes, T columns written, s sinks: the sinks hold columns [0, min(T, s)) as they came; the
    region holds columns [s, s + Q) quantized, Q = floor((T − s) / r)·r (0 while T ≤ s), exactly what
    kvcache.KiviLayer holds after the same columns; the ring holds columns [s + Q, T) as they came. Region and
    ring count columns from s (their column c − s)."""

    TENSORS = ("sink_keys", "sink_values", *KiviCodec.QUANTIZED, "ring_keys", "ring_values")
    code_blocks = True  # False: writes only fill the ring (set by StaticKVCache.code_blocks)
    views = True  # False: writes hand attention 0 columns (the kernel reads the layer; StaticKVCache.code_blocks)
    sink_keys: torch.Tensor  # [B,H,s,Dk], [B,H,s,Dv], [B,H,R,Dk], [B,H,R,Dv] in `storage` (set by allocate)
    sink_values: torch.Tensor
    ring_keys: torch.Tensor
    ring_values: torch.Tensor

    def compact(self, start: int, index: torch.Tensor) -> None:
        raise NotImplementedError("a static KIVI layer codes keys over groups of columns and keeps a ring indexed by "
                                  "column: kept tokens cannot move (config.eviction.compiled_eviction_reason)")

    @staticmethod
    def columns(options: KindOptions, length: int) -> int:
        """The sinks and whole rings (2r) after them: at least `length` columns."""
        ring, sinks = 2 * options.kivi.residual_len, options.sinks
        return sinks + -(-max(length - sinks, 1) // ring) * ring

    def __init__(self, options: KindOptions, *args, levels: tuple[torch.Tensor, torch.Tensor] | None = None,
                 **kwargs):
        kivi = options.kivi
        self.key_bits, self.value_bits = kivi.key_bits, kivi.value_bits  # kivi3 → 3 and 3, k4v3 → 4 and 3
        self.value_block = options.value_block  # b64: values in blocks of 64 channels
        self.sinks = options.sinks  # s4: columns 0..3 kept exact, never quantized
        self.group_size, self.residual_len = kivi.group_size, kivi.residual_len
        self.ring_len = 2 * self.residual_len  # a write of ≤ r columns after < r held ones never wraps onto itself
        self.outlier_percent = options.outlier_percent
        self.rotate_keys, self.rotate_values = options.rotate_keys, options.rotate_values
        if options.nuq and levels is None:
            raise ValueError("nuq codes need levels fitted to the model: build the cache with make_static_cache")
        self.levels = levels if options.nuq else None  # moved to the cache's device in allocate: graph inputs
        super().__init__(options, *args, **kwargs)

    def allocate(self) -> None:
        span = self.max_cache_len - self.sinks  # columns of the region (and of the ring tiled)
        if span <= 0 or span % self.ring_len:
            raise ValueError(f"a static KIVI cache holds its {self.sinks} sinks and a positive multiple of "
                             f"{self.ring_len} columns more (got {self.max_cache_len})")
        b, h = self.batch_size, self.num_heads
        self._make_rotations(self.k_head_dim, self.v_head_dim, self.device, self.rotate_keys, self.rotate_values)
        if self.levels is not None:
            key_levels, value_levels = self.levels
            self.levels = key_levels.to(self.device), value_levels.to(self.device)
        self.kernel_levels = tuple(  # as cpu_attention's kernel loads them; uniform codes: 0, 1, 2, …
            cpu_attention.levels16(self.levels[i] if self.levels is not None else
                                   torch.arange(2**bits, dtype=torch.float32, device=self.device))
            for i, bits in enumerate((self.key_bits, self.value_bits)))
        empty = self._quantize(torch.zeros(b, h, self.residual_len, self.k_head_dim, device=self.device),
                               torch.zeros(b, h, self.residual_len, self.v_head_dim, device=self.device))
        for name, tensor in zip(self.QUANTIZED, empty):  # one block's tensors, repeated along the sequence
            setattr(self, name, tensor.repeat(1, 1, span // self.residual_len, 1))
        for part, length in (("sink", self.sinks), ("ring", self.ring_len)):  # [B,H,s,D], [B,H,R,D]
            setattr(self, f"{part}_keys", torch.zeros(b, h, length, self.k_head_dim, dtype=self.storage,
                                                      device=self.device))
            setattr(self, f"{part}_values", torch.zeros(b, h, length, self.v_head_dim, dtype=self.storage,
                                                        device=self.device))
        self.keys = self.values = None

    def _block_rows(self, name: str, start: torch.Tensor) -> torch.Tensor:
        """[n] rows (dim -2) of tensor `name` that hold the block of r region columns from `start` (0-d)."""
        n = self._rows(name, self.residual_len)
        return start // self.residual_len * n + torch.arange(n, device=start.device)

    def nbytes(self) -> int:
        """Bytes of the tensors in TENSORS and of the codebooks (nuq), as kvcache.KiviLayer counts them."""
        return super().nbytes() + self._codebook_bytes()

    def _quantized(self, written: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """0-d Q once the columns below `written` (0-d) are written, those from `end` on being padding."""
        r = self.residual_len
        return (torch.minimum(written, end) - self.sinks).clamp(min=0) // r * r

    def write(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor, end: torch.Tensor):
        """[B,H,T,D] new K/V into `columns` [T] (consecutive) → all [B,H,S,D] K/V as attention reads them. In pieces
        of ≤ r columns, each of which completes at most one block: any T, the same fixed-shape code. Columns from
        `end` (0-d) on are padding (a compiled prefill's): never stored, never completing a block."""
        r = self.residual_len
        for start in range(0, keys.shape[-2], r):
            piece = slice(start, start + r)
            self._append(keys[..., piece, :], values[..., piece, :], columns[piece], end)
        if not self.views:
            return keys[..., :0, :], values[..., :0, :]
        return self._view(self._quantized(columns[-1] + 1, end), keys.dtype)

    def _append(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor, end: torch.Tensor) -> None:
        """[B,H,t,D] K/V (t ≤ r) into the sinks and the ring; the block of r columns they complete, if any,
        quantized into the region. Every shape is fixed: the block ending at the new Q is quantized whether or not
        it is new, and written over itself when it is not (`where`)."""
        r = self.residual_len
        slots = (columns - self.sinks) % self.ring_len  # [t] (a sink column's slot is left as it is)
        real = ((columns >= self.sinks) & (columns < end))[:, None]  # [t,1]
        for ring, new in ((self.ring_keys, keys), (self.ring_values, values)):
            ring.index_copy_(2, slots, torch.where(real, new.to(self.storage), ring.index_select(2, slots)))
        if not self.code_blocks:  # the engine knows these columns are past the sinks and complete no block
            return  # (static_state.StaticDecodeState._forward, StaticKVCache.needs_coding)
        self._keep_sinks(keys, values, columns, end)
        done = self._quantized(columns[-1] + 1, end)  # 0-d: Q after these columns
        flush = done > self._quantized(columns[0], end)  # 0-d bool: a block was completed
        start = (done - r).clamp(min=0)  # its first region column (0 and no flush while Q is 0)
        block = (start + torch.arange(r, device=columns.device)) % self.ring_len  # [r] its ring slots
        coded = self._quantize(self.ring_keys.index_select(2, block), self.ring_values.index_select(2, block))
        for name, value in zip(self.QUANTIZED, coded):
            tensor, rows = getattr(self, name), self._block_rows(name, start)
            if not tensor.shape[-1]:  # no outliers (k = 0)
                continue
            tensor.index_copy_(2, rows, torch.where(flush, value, tensor.index_select(2, rows)))

    def _keep_sinks(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor, end: torch.Tensor) -> None:
        """Columns of [B,H,t,D] K/V below s (and below `end`) into their sink slots; the other slots unchanged.
        Fixed shapes: each of the s slots picks its column of the piece, or itself (`where`)."""
        if not self.sinks:
            return
        sink = torch.arange(self.sinks, device=columns.device)  # [s] the sink columns
        offset = sink - columns[0]  # [s] where each lies in the piece (columns are consecutive)
        taken = ((offset >= 0) & (offset < columns.shape[0]) & (sink < end))[:, None]  # [s,1]
        index = offset.clamp(0, columns.shape[0] - 1)
        for held, new in ((self.sink_keys, keys), (self.sink_values, values)):
            held.copy_(torch.where(taken, new.index_select(2, index).to(self.storage), held))

    def kernel_reads(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32  # the region is decoded, outliers restored and rotated back in float32

    def sides(self) -> tuple[cpu_attention.Side, cpu_attention.Side]:
        """The region's K and V as cpu_attention's kernel reads them."""
        sides = []
        for side, bits, dim in (("key", self.key_bits, self.k_head_dim), ("value", self.value_bits, self.v_head_dim)):
            padded = -(-dim // self.value_block) * self.value_block
            layout = (dict(group=self.group_size) if side == "key" else
                      dict(group=self.value_block, padded=padded, plane=plane_bytes(padded, bits) if bits != 3 else 0))
            sides.append(cpu_attention.Side(
                getattr(self, f"{side}_codes"), f"kivi_{side}", dim, scales=getattr(self, f"{side}_scales"),
                mins=getattr(self, f"{side}_mins"), bits=bits, chunk=self.group_size,
                levels=self.kernel_levels[side == "value"],
                outliers=getattr(self, f"{side}_outliers"), index=getattr(self, f"{side}_outlier_index"), **layout))
        keys, values = sides
        return keys, values

    def segments(self, side: str) -> list[cpu_attention.Segment]:
        """K's or V's segments under the kernel's limit Q (`_quantized`): the sinks [0, s), the region [s, s + Q)
        and the ring [s + Q, S) (column s + c in slot c mod R). A rotated side's region is read against the rotated
        query (keys) or adds to an output rotated back after (values)."""
        s, dim = self.sinks, self.k_head_dim if side == "key" else self.v_head_dim
        rotated = (self.key_rotation if side == "key" else self.value_rotation) is not None
        storage = cpu_attention.STORAGE_FORMATS[self.storage]
        plain = int(rotated)  # the sinks and ring: the unrotated query / output
        region = self.sides()[side == "value"]
        segments = [cpu_attention.Segment(region, start=s, stop=s, base=s),
                    cpu_attention.Segment(cpu_attention.Side(getattr(self, f"ring_{side}s"), storage, dim), start=s,
                                          stop=self.max_cache_len, start_plus_limit=True, stop_plus_limit=False,
                                          base=s, modulo=self.ring_len, query=plain, output=plain)]
        if s:
            segments.append(cpu_attention.Segment(cpu_attention.Side(getattr(self, f"sink_{side}s"), storage, dim),
                                                  stop=s, stop_plus_limit=False, query=plain, output=plain))
        return segments

    def attend(self, query: torch.Tensor, mask: torch.Tensor, scaling: float, columns: torch.Tensor,
               end: torch.Tensor) -> torch.Tensor:
        """One query column [B,Hq,1,D], [B,S] bool mask → [B,1,Hq,Dv] over the columns `_view` would hand, in one
        kernel call per side: the region in its codes, the sinks and the ring as they are (`segments`). A rotated
        side's region takes the query rotated (keys: q·R against the stored R-rotated keys) or its output rotated
        back (values: (Σ p·v̂)·Rᵀ)."""
        b, heads, _, dim = query.shape
        h = self.num_heads
        done = self._quantized(columns[-1] + 1, end)  # 0-d: region columns below it are quantized
        rows = query.reshape(b, h, heads // h, dim).float()  # [B,H,G,D]
        queries = rows[None] if self.key_rotation is None else torch.stack([rows @ self.key_rotation, rows])
        probs = cpu_attention.scores(queries, self.segments("key"), mask, mask.shape[-1], done, scaling).softmax(-1)
        out = cpu_attention.weighted(probs, self.segments("value"), done, 1 + (self.value_rotation is not None))
        out = out[0] if self.value_rotation is None else out[0] @ self.value_rotation.T + out[1]  # [B,H,G,Dv]
        return out.reshape(b, 1, heads, self.v_head_dim).to(query.dtype)

    def _view(self, done: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[B,H,S,D] K and V in `dtype`: the sinks, then the region and ring (`_region`)."""
        keys, values = self._region(done, dtype)
        if not self.sinks:
            return keys, values
        return (torch.cat([self.sink_keys.to(dtype), keys], dim=-2),
                torch.cat([self.sink_values.to(dtype), values], dim=-2))

    def _region(self, done: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[B,H,S−s,D] K and V in `dtype` of the columns past the sinks: below `done` (0-d) dequantized from the
        region, the others read from the ring (column c in slot c mod R; columns not yet written are masked by the
        caller)."""
        span = self.max_cache_len - self.sinks
        quantized = (torch.arange(span, device=done.device) < done)[:, None]  # [S−s,1]
        held = {name: getattr(self, name) for name in self.QUANTIZED}  # the whole region (chunks past Q: masked)
        keys = self._decoded(held, "key", span, fused=True).to(dtype)
        values = self._decoded(held, "value", self.v_head_dim, fused=True).to(dtype)
        return (torch.where(quantized, keys, self._tiled(self.ring_keys).to(dtype)),
                torch.where(quantized, values, self._tiled(self.ring_values).to(dtype)))

    def _tiled(self, ring: torch.Tensor) -> torch.Tensor:
        """[B,H,R,D] → [B,H,S−s,D], column c = slot c mod R (a broadcast the compiled graph folds into its kernel)."""
        b, h, _, d = ring.shape
        tiles = (self.max_cache_len - self.sinks) // self.ring_len
        return ring[:, :, None].expand(b, h, tiles, self.ring_len, d).reshape(b, h, -1, d)

    def take_columns(self, row: int | slice, source: StaticPlainLayer, source_row: int | slice, start: int,
                     stop: int, shift: int = 0) -> None:
        """As StaticPlainLayer's, for tokens that start at a block boundary and a shift of whole blocks (start and
        shift multiples of r; no sinks): the region's blocks that hold columns [start, stop) move by shift / r,
        and the whole ring is taken turned by the shift (column c's slot is c mod 2r; its newest columns are the
        source's)."""
        r = self.residual_len
        assert isinstance(source, StaticKiviLayer) and not self.sinks and start % r == 0 and shift % r == 0
        first, last, blocks = start // r, -(-stop // r), shift // r  # source blocks [first, last)
        for name in self.QUANTIZED:
            n = self._rows(name, r)
            getattr(self, name)[row, :, (first + blocks) * n:(last + blocks) * n] = \
                getattr(source, name)[source_row, :, first * n:last * n].clone()
        for name in ("ring_keys", "ring_values"):
            getattr(self, name)[row] = getattr(source, name)[source_row].roll(shift % self.ring_len, dims=-2)

    def rollback(self, kept: int, held: int) -> None:
        """After the write position moved back from `held` to `kept` columns: quantized columns past
        s + floor((kept − s) / r)·r return to the ring dequantized, as kvcache.KiviLayer.crop returns them to its
        residual, and the next completed block quantizes them again. Sink columns past `kept` are simply written
        again."""
        r = self.residual_len
        kept, held = max(kept - self.sinks, 0), max(held - self.sinks, 0)  # region columns
        start = kept // r * r
        if kept == start or start >= held // r * r:  # nothing kept past Q, or Q did not move
            return
        keys, values = self._region(torch.tensor(held // r * r, device=self.device), self.storage)
        slots = torch.arange(start, kept, device=self.device)
        self.ring_keys.index_copy_(2, slots % self.ring_len, keys.index_select(2, slots))
        self.ring_values.index_copy_(2, slots % self.ring_len, values.index_select(2, slots))
