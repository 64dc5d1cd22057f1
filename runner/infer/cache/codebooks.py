"""The fitted codes of the KIVI `nuq` option: per layer, for keys and for values, 2^b levels fitted by Lloyd-Max
(kvcodes.fit_levels) to the normalized K/V the model itself produces on calibration text, as the KIVI layer will
quantize them (after the sinks, rotated and with outliers removed when those options are on).

Fitted once per (model, bits, options) and kept as JSON under ~/.cache/runner/codebooks/<content key>.json; the key
is a sha256 of the model's fingerprint (content hash, dtype), the options and the calibration settings, so another
model or option never reads it. A file that is not JSON, or does not fit (another layer count, level count or model)
is fitted again with a warning naming it; a cache folder that cannot hold the codes is a warning (they serve this
process only). Calibration: 4 windows of 512 tokens of `pydoc` from the odd eighths of the text
(the quality probe's 3 windows start at 0, 1/3, 2/3: no overlap). Needs the tokenizer load_model recorded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from typing import TypedDict

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache

from runner.errors import CacheError, InferenceError
from runner.files import cache_write_json
from runner.infer.config.kinds import KindOptions
from runner.infer.loading.models import LOADED
from runner.infer.loading.pinned import cache_root
from runner.infer.loading.texts import load_text, token_windows
from runner.infer.quant.formats import BLOCK
from runner.infer.quant.kivi_math import fit_levels, normalized, outlier_count, rotate, split_outliers

log = logging.getLogger(__name__)
FORMAT = 1  # bump when the fit changes: older files are then never read


class Calibration(TypedDict):
    text: str  # a loading.texts source
    tokens: int  # per window
    slots: int  # the text cut into this many equal slots
    windows: list[int]  # the slots whose first window is run
    samples: int  # most normalized values a side's fit takes


CALIBRATION: Calibration = {"text": "pydoc", "tokens": 512, "slots": 8, "windows": [1, 3, 5, 7], "samples": 1 << 18}
_FITTED: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def fitted_levels(model, options: KindOptions) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(key levels fp16 [2^key_bits], value levels [2^value_bits]) per layer of `model` for a KIVI kind's options:
    from this process, the disk cache, or fitted."""
    if model not in LOADED:
        raise InferenceError("the nuq cache option fits codes on calibration text with the model's tokenizer: load "
                             "the model with runner.infer.loading.models.load_model")
    tokenizer, fingerprint = LOADED[model]
    fitted = {k: getattr(options, k) for k in ("group_size", "sinks", "outlier_percent", "rotate_keys",
                                                "rotate_values")}
    kivi = options.kivi
    bits = kivi.key_bits if kivi.key_bits == kivi.value_bits else [kivi.key_bits, kivi.value_bits]
    if options.value_block != BLOCK:  # absent at its default: codebooks fitted before b existed stay valid
        fitted["value_block"] = options.value_block
    key = hashlib.sha256(json.dumps({"format": FORMAT, "model": fingerprint, "bits": bits, "options": fitted,
                                     "calibration": CALIBRATION}, sort_keys=True, default=str).encode()).hexdigest()
    if key not in _FITTED:
        path = cache_root() / "codebooks" / f"{key}.json"
        doc = {"model": fingerprint, "bits": bits, "options": fitted}
        layers = read_codebook(path, doc, model.config.get_text_config().num_hidden_layers,
                               (kivi.key_bits, kivi.value_bits))
        if layers is None:
            log.info("fitting %s-bit nuq codes to %s (%s)", bits, fingerprint.get("source", "the model"), path.name)
            layers = fit_model_levels(model, tokenizer, options)
            try:
                cache_write_json(path, {"levels": layers, **doc})
            except CacheError as exc:
                log.warning("%s; the fitted codes serve this process only", exc)
        device = next(model.parameters()).device
        _FITTED[key] = [(torch.tensor(k, dtype=torch.float16, device=device),
                         torch.tensor(v, dtype=torch.float16, device=device)) for k, v in layers]
    return _FITTED[key]


def read_codebook(path, doc: dict, layers: int, bits: tuple[int, int]) -> list | None:
    """The levels the codebook file `path` holds, or None (fit them) when there is none or it does not fit (said
    at warning level, naming the file and what did not match)."""
    try:
        found = json.loads(path.read_bytes())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as exc:
        problem = f"is unreadable ({exc.strerror})" if isinstance(exc, OSError) else f"is not JSON ({exc})"
    else:
        problem = codebook_problem(found, doc, layers, bits)
    if problem:
        log.warning("codebook %s %s: fitting it again", path, problem)
        return None
    return found["levels"]


def codebook_problem(found, doc: dict, layers: int, bits: tuple[int, int]) -> str:
    """What makes the codebook `found` (a file's JSON) unfit for the model and options `doc` names, with `layers`
    layers and (key, value) `bits`; "" when it fits."""
    if not isinstance(found, dict):
        return "is not a JSON object"
    missing = [name for name in ("levels", *doc) if name not in found]
    if missing:
        return f"lacks {', '.join(missing)}"
    for name, want in doc.items():
        if found[name] != json.loads(json.dumps(want, default=str)):
            return f"is for {name} {found[name]!r}, not {want!r}"
    levels = found["levels"]
    if not isinstance(levels, list) or len(levels) != layers:
        count = f"{len(levels)} layers" if isinstance(levels, list) else "levels that are not a list"
        return f"has {count}; the model has {layers}"
    for n, layer in enumerate(levels):
        if not (isinstance(layer, list) and len(layer) == 2):
            return f"layer {n}: expected [key levels, value levels]"
        for side, values, b in zip(("key", "value"), layer, bits):
            if not (isinstance(values, list) and len(values) == 1 << b):
                found = len(values) if isinstance(values, list) else "no list of"
                return f"layer {n}: {found} {side} levels; {b} bits take {1 << b}"
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
                return f"layer {n}: a {side} level that is not a finite number"
    return ""


@torch.inference_mode()
def fit_model_levels(model, tokenizer, options: KindOptions) -> list[list[list[float]]]:
    """Run the calibration windows through `model`; per layer [key levels, value levels] as plain floats."""
    windows = token_windows(tokenizer, load_text(CALIBRATION["text"]), CALIBRATION["tokens"], CALIBRATION["slots"])
    ids = torch.tensor([windows[i] for i in CALIBRATION["windows"]], device=next(model.parameters()).device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    kivi = options.kivi
    levels: list[list[list[float]]] = []
    for layer in cache.layers:
        assert isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None, \
            "the calibration forward fills every layer's K/V"
        levels.append([fit_levels(_samples(layer.keys, options, True), kivi.key_bits).tolist(),
                       fit_levels(_samples(layer.values, options, False), kivi.value_bits).tolist()])
    return levels


def _samples(x: torch.Tensor, options: KindOptions, keys: bool) -> torch.Tensor:
    """[W,H,T,D] K or V → the normalized values the KIVI layer would code (sinks dropped, whole groups, rotated,
    outliers out), at most CALIBRATION["samples"] of them evenly strided."""
    g = options.kivi.group_size
    x = x[..., options.sinks:, :].float()
    x = x[..., :x.shape[-2] // g * g, :]
    if options.rotate_keys if keys else options.rotate_values:
        x = rotate(x)
    count = outlier_count(options.outlier_percent, g, x.shape[-1])
    if count:
        x = split_outliers(x, count, g, options.value_block, per_channel=keys)[0]
    u = normalized(x, g, dim=-2) if keys else normalized(x, options.value_block, dim=-1)
    u = u.flatten()
    return u[::max(1, u.numel() // CALIBRATION["samples"])]
