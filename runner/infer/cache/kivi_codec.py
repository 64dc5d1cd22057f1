"""How a KIVI layer codes a block of K/V with its options, and decodes it: shared by the eager layer
(kvcache.KiviLayer) and the static one of the compiled engine (static_kivi.StaticKiviLayer), so both engines store and
hand attention the same values (the arithmetic is kvcodes.py's and quant.py's).

Coding [B,H,n,D] K/V (n a multiple of g): rotate (rot, rotv), take the outliers out (o), then uniform codes
(quant.quantize_groups) or the fitted levels (nuq: kvcodes.quantize_levels): keys per channel over groups of g
tokens at bk bits, values per token in blocks of bs channels at bv bits. Decoding undoes it in the reverse order,
in float32: codes, outliers written back, inverse rotation.
Owns: `KiviCodec`, a mixin of methods over the layer's option attributes, and the names of the quantized tensors.
Knows nothing of how a layer stores its columns, of compilation or of models.
"""

from __future__ import annotations

import torch

from runner.infer.quant.formats import dequantize_groups, dequantize_groups_expr, quantize_groups
from runner.infer.quant.kivi_math import (
    dequantize_levels,
    hadamard_rotation,
    index_dtype,
    load_outlier_ops,
    outlier_count,
    quantize_levels,
    restore_outliers,
    rotate,
    split_outliers,
    unrotate,
)


class KiviCodec:
    """The options' arithmetic over a layer's attributes: key_bits, value_bits, group_size, value_block,
    outlier_percent, levels ((key levels, value levels) or None) and the rotation matrices `key_rotation`,
    `value_rotation` (None when off; made by `_make_rotations` before the first coding, so a compiled graph reads
    them as the layer's tensors)."""

    GROUPS = ("key_codes", "key_scales", "key_mins", "value_codes", "value_scales", "value_mins")  # plain KIVI's
    QUANTIZED = (*GROUPS, "key_outliers", "key_outlier_index", "value_outliers", "value_outlier_index")
    PER_GROUP = ("key_scales", "key_mins", "key_outliers", "key_outlier_index", "value_outliers",
                 "value_outlier_index")
    # The options the layer sets (from KindOptions) before coding anything:
    key_bits: int
    value_bits: int
    group_size: int
    value_block: int
    outlier_percent: float
    levels: tuple[torch.Tensor, torch.Tensor] | None
    key_rotation: torch.Tensor | None = None
    value_rotation: torch.Tensor | None = None

    def _make_rotations(self, key_dim: int, value_dim: int, device: torch.device, rotate_keys: bool,
                        rotate_values: bool) -> None:
        if self.outlier_percent and torch.device(device).type == "cpu":
            load_outlier_ops()  # the outliers' selections on runner's kernels, decided before any trace
        self.key_rotation = hadamard_rotation(key_dim, device) if rotate_keys else None
        self.value_rotation = hadamard_rotation(value_dim, device) if rotate_values else None

    @property
    def plain(self) -> bool:
        """No outliers, rotation or fitted levels: plain KIVI, which the eager layer dequantizes in place."""
        return (self.levels is None and not self.outlier_percent and self.key_rotation is None
                and self.value_rotation is None)

    def _codebook_bytes(self) -> int:
        """Bytes of the fitted levels (nuq), 0 without them."""
        return sum(t.numel() * t.element_size() for t in self.levels or ())

    def _quantize(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[B,H,n,D] K/V, n a multiple of group_size → the QUANTIZED tensors of those n tokens."""
        keys = keys if self.key_rotation is None else rotate(keys, self.key_rotation)
        values = values if self.value_rotation is None else rotate(values, self.value_rotation)
        keys, key_outliers = self._outliers(keys, per_channel=True)
        values, value_outliers = self._outliers(values, per_channel=False)
        kb, vb, g, block = self.key_bits, self.value_bits, self.group_size, self.value_block
        if self.levels is not None:
            return (*quantize_levels(keys, self.levels[0], kb, g, dim=-2),
                    *quantize_levels(values, self.levels[1], vb, block, dim=-1), *key_outliers, *value_outliers)
        return (*quantize_groups(keys, kb, g, dim=-2), *quantize_groups(values, vb, block, dim=-1),
                *key_outliers, *value_outliers)

    def _outliers(self, x: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B,H,n,D] → (x with its outliers replaced, (values, indices) [B,H,n/g,k]); k = 0: x as it is."""
        count, g = outlier_count(self.outlier_percent, self.group_size, x.shape[-1]), self.group_size
        if count and x.shape[-2]:
            filled, values, index = split_outliers(x.float(), count, g, self.value_block, per_channel)
            return filled, (values, index)
        shape = (*x.shape[:-2], x.shape[-2] // g, count)
        return x, (x.new_empty(shape, dtype=torch.float16), x.new_empty(shape, dtype=index_dtype(g, x.shape[-1])))

    def _rows(self, name: str, tokens: int) -> int:
        """Rows (dim -2) of tensor `name` that `tokens` quantized tokens take (tokens a multiple of group_size)."""
        if name == "key_codes":
            return tokens * self.key_bits // 8
        return tokens // self.group_size if name in self.PER_GROUP else tokens

    def _decoded(self, t: dict[str, torch.Tensor], side: str, length: int, fused: bool = False) -> torch.Tensor:
        """float32 K (`side` "key") or V of the quantized tensors `t`, `length` tokens (keys) or channels (values)
        long along their quantized axis: codes, then the outliers written back, then the inverse rotation.
        `fused`: codes decoded by expressions a compiled graph fuses (quant.dequantize_groups_expr,
        kvcodes.dequantize_levels(fused=True)); the same floats as eagerly."""
        key = side == "key"
        bits, group, dim = (self.key_bits, self.group_size, -2) if key else (self.value_bits, self.value_block, -1)
        codes, scales, mins = t[f"{side}_codes"], t[f"{side}_scales"], t[f"{side}_mins"]
        if self.levels is not None:
            x = dequantize_levels(codes, scales, mins, self.levels[0 if key else 1], bits, group, length, dim=dim,
                                  fused=fused)
        else:
            groups = dequantize_groups_expr if fused else dequantize_groups
            x = groups(codes, scales, mins, bits, group, length, torch.float32, dim=dim)
        x = restore_outliers(x, t[f"{side}_outliers"], t[f"{side}_outlier_index"], self.group_size)
        rotation = self.key_rotation if key else self.value_rotation
        return x if rotation is None else unrotate(x, rotation)
