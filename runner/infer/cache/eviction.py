"""Which tokens an eviction method keeps: one scoring function per method, mirroring kvpress's presses (0.5.5), and
the one rule that turns scores into kept columns (`choose`).

Shapes: B rows, Hq query heads, H KV heads (G = Hq / H per group), T the tokens scored, D head_dim.
Every scorer returns scores [B,H,T], higher = kept. Queries are recomputed from the attention module's input hidden
states (q_proj, q_norm where the model has one, RoPE from the module's `position_embeddings`), as kvpress's
`get_prerope_query_states`: no eager attention weights needed. Where a method scores per query head, a KV head
takes the mean over its group (kvpress's GQA rule; TOVA's mean over every head, as kvpress).
    streaming  StreamingLLM: the newest tokens (the sinks are protected by `choose`)
    h2o        observed attention: the attention each key received from the forward's queries, divided by the
               number of queries that could see it (kvpress's ObservedAttentionPress)
    snapkv     the attention of the last `window` queries, averaged over them and pooled over 5 neighbours
    tova       the attention of the last query, averaged over every head
    knorm      minus the key's L2 norm (low-norm keys kept)
    expected   Expected Attention: keys scored against the mean and covariance of the forward's pre-RoPE queries
               (after the sinks), rotated by RoPE averaged over the next 512 positions; softmax, group mean, times
               the value's norm (kvpress's ExpectedAttentionPress with its defaults)
Owns the scorers, `queries` and `choose`. Knows nothing of cache layers or hooks (cache/evicting.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from runner.infer.config.eviction import EvictionOptions

FUTURE_POSITIONS = 512  # Expected Attention: the RoPE rotation averaged over this many positions ahead (kvpress)
POOL = 5  # SnapKV's pooling kernel (kvpress's kernel_size)
QUERY_CHUNK = 256  # H2O computes attention in chunks of this many queries: T×T scores never at once


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def queries(module, hidden: torch.Tensor, cos: torch.Tensor | None = None,
            sin: torch.Tensor | None = None) -> torch.Tensor:
    """The attention module's queries of `hidden` [B,t,hidden] → [B,Hq,t,D]: q_proj, q_norm where the model has
    one, then RoPE with cos/sin [B,t,D] (none given: before RoPE)."""
    q = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim).transpose(1, 2)
    if getattr(module, "q_norm", None) is not None:
        q = module.q_norm(q)
    if cos is None or sin is None:
        return q
    return q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)


def group_mean(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B,Hq,T] → [B,H,T]: each KV head the mean of its group of query heads."""
    b, hq, t = scores.shape
    return scores.view(b, kv_heads, hq // kv_heads, t).mean(2)


def attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None, first: int) -> torch.Tensor:
    """Causal attention weights of queries q [B,Hq,w,D] at columns first..first+w−1 over keys [B,H,T,D] → float32
    [B,Hq,w,T]; pad columns (valid [B,T] False) get none, a pad query's row is all zero."""
    groups = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1).float()
    logits = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B,Hq,w,T]
    rows = torch.arange(first, first + q.shape[-2], device=q.device)[:, None]
    allowed = torch.arange(keys.shape[-2], device=q.device)[None, :] <= rows  # [w,T]
    allowed = allowed[None, None] if valid is None else allowed[None, None] & valid[:, None, None, :]
    weights = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    return weights.nan_to_num(0.0)


def score_streaming(keys: torch.Tensor) -> torch.Tensor:
    """StreamingLLM: the newest first (position / T in [0, 1)); `choose` protects the sinks."""
    b, h, t, _ = keys.shape
    return (torch.arange(t, device=keys.device, dtype=torch.float32) / t).expand(b, h, t)


def score_knorm(keys: torch.Tensor) -> torch.Tensor:
    """Knorm: −‖k‖₂, in float32 at least so that low-precision keys do not tie (kvpress)."""
    return -torch.linalg.vector_norm(keys, dim=-1, dtype=torch.promote_types(keys.dtype, torch.float32))


def score_tova(q_last: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """TOVA: the last query's [B,Hq,1,D] attention over the keys [B,H,T,D], averaged over every query head."""
    weights = attention(q_last, keys, valid, keys.shape[-2] - 1)[:, :, 0]  # [B,Hq,T]
    return weights.mean(1, keepdim=True).expand(-1, keys.shape[1], -1)


def score_snapkv(q_window: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """SnapKV: the window's queries [B,Hq,w,D] (the last w columns) over the keys, averaged over the window,
    pooled over POOL neighbours among the keys before the window only (zero-padded at both ends, as kvpress: the
    window's own columns, which draw much of its attention, do not raise the two keys just before it), group mean.
    The window itself is protected by `choose`; its columns keep their unpooled weights."""
    w, t = q_window.shape[-2], keys.shape[-2]
    weights = attention(q_window, keys, valid, t - w).mean(-2)  # [B,Hq,T]
    before = F.avg_pool1d(weights[..., : t - w], kernel_size=POOL, padding=POOL // 2, stride=1)
    return group_mean(torch.cat([before, weights[..., t - w:]], dim=-1), keys.shape[1])


def score_h2o(q_all: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None, first: int = 0) -> torch.Tensor:
    """H2O / observed attention: attention each key got from the queries [B,Hq,w,D] of columns first..T−1 (a
    prompt forward: all T), summed and divided by the number of those queries that see key j; group mean."""
    t, w = keys.shape[-2], q_all.shape[-2]
    total = torch.zeros(*q_all.shape[:2], t, device=keys.device)
    for start in range(0, w, QUERY_CHUNK):
        total += attention(q_all[:, :, start:start + QUERY_CHUNK], keys, valid, first + start).sum(-2)
    seen_by = torch.arange(t, 0, -1, device=keys.device, dtype=torch.float32).clamp(max=w)
    return group_mean(total / seen_by, keys.shape[1])


def score_expected(q_prerope: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None,
                   future_cos: torch.Tensor, future_sin: torch.Tensor, sinks: int,
                   query_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Expected Attention: pre-RoPE queries [B,Hq,T,D] of the forward's columns after the sinks give a mean μ and
    covariance Σ per head; R = mean over the next positions of RoPE's rotation (future_cos/sin [n,D]); then
    score(k) = softmax_T(k·Rμ/√d + ½ kᵀRΣRᵀk/d), group mean, × ‖v‖. Pads weigh nothing in μ and Σ: valid [B,T] says
    which keys are real, query_valid [B,≥Tq] (default: valid) which queries (its last Tq columns)."""
    d = q_prerope.shape[-1]
    q = q_prerope[:, :, sinks:].float()
    query_valid = valid if query_valid is None else query_valid
    weight = (torch.ones(q.shape[0], q.shape[2], device=q.device) if query_valid is None
              else query_valid[:, -q_prerope.shape[2]:][:, sinks:].float())
    weight = (weight / weight.sum(-1, keepdim=True).clamp(min=1))[:, None, :, None]  # [B,1,T',1]
    mu = (q * weight).sum(2)  # [B,Hq,D]
    centered = (q - mu[:, :, None]) * weight.sqrt()
    cov = centered.transpose(-1, -2) @ centered  # [B,Hq,D,D]
    eye = torch.eye(d, device=q.device)
    swap = torch.zeros(d, d, device=q.device)  # swap @ x = rotate_half(x)
    swap[: d // 2, d // 2:], swap[d // 2:, : d // 2] = -torch.eye(d // 2), torch.eye(d // 2)
    rotation = (future_cos.float()[:, :, None] * eye + future_sin.float()[:, :, None] * swap).mean(0)  # [D,D]
    mu, cov = mu @ rotation.T, rotation @ cov @ rotation.T
    groups = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1).float()  # [B,Hq,T,D]
    logits = (k @ mu[..., None])[..., 0] / math.sqrt(d) + torch.einsum("bhtd,bhde,bhte->bht", k, cov, k) / d / 2
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    scores = group_mean(logits.softmax(-1).nan_to_num(0.0), keys.shape[1])
    return scores * torch.linalg.vector_norm(values.float(), dim=-1)


def choose(scores: torch.Tensor, kept: int, valid: torch.Tensor | None, sinks: int, window: int) -> torch.Tensor:
    """Scores [B,H,T] → the kept columns [B,H,kept], ascending (the stored order stays chronological).

    Pad columns (valid [B,T] False) go first; then the lowest scores. Protected whatever their score: the first
    `sinks` real columns of each row, then the last `window` columns; when more are protected than kept, the sinks
    and the newest of the window win."""
    b, h, t = scores.shape
    final = scores.double().clone()
    position = torch.arange(t, device=scores.device, dtype=torch.float64)
    if window:
        final[..., t - window:] = 1e15 + position[t - window:]
    if sinks:
        real = torch.ones(b, t, dtype=torch.bool, device=scores.device) if valid is None else valid
        first = real & (real.cumsum(-1) <= sinks)  # [B,T]
        final = torch.where(first[:, None, :], 2e15 + position, final)
    if valid is not None:
        final = final.masked_fill(~valid[:, None, :], float("-inf"))
    return final.topk(min(kept, t), dim=-1).indices.sort(-1).values


def score(options: EvictionOptions, module, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None,
          q_post, q_pre, future, first: int = 0) -> torch.Tensor:
    """The method's scores [B,H,T] of keys / values [B,H,T,D]. The queries are of columns first..T−1 (a prompt
    forward: all, first 0; the decoding schedule: the last N): `q_post(columns)` gives the post-RoPE queries of
    the last `columns` of them [B,Hq,columns,D] (None: all), `q_pre()` all of them before RoPE, `future()`
    RoPE's (cos, sin) [n,D] of the next positions. Each is computed only when the method asks."""
    method, t, w = options.method, keys.shape[-2], keys.shape[-2] - first
    if method == "streaming":
        return score_streaming(keys)
    if method == "knorm":
        return score_knorm(keys)
    if method == "tova":
        return score_tova(q_post(1), keys, valid)
    if method == "snapkv":
        return score_snapkv(q_post(max(1, min(options.window or 1, t - 1, w))), keys, valid)
    if method == "h2o":
        return score_h2o(q_post(None), keys, valid, first)
    cos, sin = future()
    skip = max(0, min((options.sinks) - first, w - 1))  # the sinks' own queries, when they are among them
    s = min(options.sinks, t - 1)  # the sink keys stay out of the softmax (kvpress); `choose` keeps them
    scores = score_expected(q_pre(), keys[:, :, s:], values[:, :, s:], None if valid is None else valid[:, s:],
                            cos, sin, skip, query_valid=valid)  # the sink keys' columns out, their queries in
    return F.pad(scores, (s, 0), value=0.0)
