"""How much a KV-cache kind (or a weight quantization: run the probe on the quantized model and compare it with the
unquantized model's run) changes a model's predictions, measured on real text.

A `Probe` holds the token ids (built once from real text); `run_probe` pushes them through a cache
of one kind and keeps the log-probabilities; `compare` turns a reference run and a candidate run
into the gate metrics. Every prediction scored here is made while reading K/V back from the cache:
    windows: prefill `prompt_len` tokens → `decode_steps` teacher-forced one-token steps, each scored
    perplexity: one long window, fed through the cache in chunks
    needle: a fact early in a long context, its answer teacher-forced at the end
KL is KL(reference ‖ candidate) = Σ p_ref · (log p_ref − log p_cand), in nats.
Does not know about gates, budgets or plans (see autocache.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runner.errors import DataError, InferenceError
from runner.infer.cache.layers import cache_bytes
from runner.infer.cache.registry import make_cache
from runner.infer.cache.window import DecodePlan, make_planned_cache
from runner.infer.decode.forward import decode_one_token, forward_last, positions_for, prefill, trim_mask
from runner.infer.loading.texts import EvalText, needle_prompt, token_windows

PPL_CHUNK = 128  # tokens per forward when feeding the perplexity window through the cache


@dataclass(frozen=True)
class Probe:
    windows: torch.Tensor  # [W, P+S+1] token ids
    prompt_len: int  # P
    ppl_ids: torch.Tensor  # [1, L]
    needle_ids: torch.Tensor  # [1, N] prompt that ends just before the answer
    answer_ids: torch.Tensor  # [A]


@dataclass
class ProbeRun:
    """What one cache kind made of the probe."""

    step_logprobs: torch.Tensor  # [W, S, V] float32 log-softmax at each decode step
    step_nll: float  # mean NLL of the true next tokens over the decode steps (nats/token)
    ppl_nll: float  # mean NLL over the perplexity window (nats/token)
    needle_logprobs: torch.Tensor  # [A, V] at each answer token
    needle_found: bool  # greedy would have produced the needle's answer
    bytes_per_token: float  # measured from the perplexity run's cache


def build_probe(tokenizer, text: EvalText, prompt_len: int, decode_steps: int, windows: int, ppl_len: int,
                device: torch.device) -> Probe:
    ids = token_windows(tokenizer, text, prompt_len + decode_steps + 1, windows)
    ppl = token_windows(tokenizer, text, ppl_len, 1)
    try:
        _, answer = needle_prompt(tokenizer, text, ppl_len)
        needle, answer = needle_prompt(tokenizer, text, ppl_len - len(answer))  # prompt + answer fit in ppl_len
    except DataError as exc:
        raise InferenceError(f"{exc}: raise cache_quality_ppl_len (and max_seq_len, which caps it)") from None
    return Probe(windows=torch.tensor(ids, device=device), prompt_len=prompt_len,
                 ppl_ids=torch.tensor(ppl, device=device), needle_ids=torch.tensor([needle], device=device),
                 answer_ids=torch.tensor(answer, device=device))


@torch.inference_mode()
def run_probe(model, probe: Probe, kind: str | None) -> ProbeRun:
    """Everything the gates need from one cache kind (None = the model's own dtype, the reference)."""
    P = probe.prompt_len
    step_logprobs = teacher_forced_logprobs(model, probe.windows, P, kind, score_prefill=False)
    step_nll = float(-step_logprobs.gather(-1, probe.windows[:, P + 1:, None]).mean())

    cache = make_cache(kind, model)
    ppl_nll, n_tokens = chunked_nll(model, probe.ppl_ids, cache), probe.ppl_ids.numel()
    bytes_per_token = cache_bytes(cache) / n_tokens
    del cache

    needle_ids = torch.cat([probe.needle_ids, probe.answer_ids[None]], dim=1)
    needle_logprobs = teacher_forced_logprobs(model, needle_ids, probe.needle_ids.shape[1], kind,
                                              score_prefill=True)[0]
    found = bool((needle_logprobs.argmax(-1) == probe.answer_ids).all())
    return ProbeRun(step_logprobs, step_nll, ppl_nll, needle_logprobs, found, bytes_per_token)


@torch.inference_mode()
def teacher_forced_logprobs(model, ids: torch.Tensor, prompt_len: int, kind: str | None,
                            score_prefill: bool, cache=None) -> torch.Tensor:
    """Prefill ids[:, :P], then feed ids[:, P], ids[:, P+1], ... one token at a time through the cache (a new one
    of `kind`, or `cache` when given: the caller may then measure it).

    Returns log-probs of each next true token's position: [B, T-P-1, V] for the decode steps, with the
    prefill's prediction of ids[:, P] in front when `score_prefill` ([B, T-P, V]).
    """
    cache = make_cache(kind, model) if cache is None else cache
    batch, total = ids.shape
    mask = torch.ones_like(ids)
    logits = forward_last(model, ids[:, :prompt_len], mask[:, :prompt_len],
                          positions_for(None, mask[:, :prompt_len]), cache)  # [B, V]
    scored = [logits] if score_prefill else []
    for pos in range(prompt_len, total - 1):
        position = torch.full((batch, 1), pos, device=ids.device)
        scored.append(forward_last(model, ids[:, pos:pos + 1], mask[:, :pos + 1], position, cache))
    return torch.log_softmax(torch.stack(scored, dim=1).float(), dim=-1)


@torch.inference_mode()
def chunked_nll(model, ids: torch.Tensor, cache) -> float:
    """Mean NLL of ids[:, 1:] with the window fed through `cache` PPL_CHUNK tokens at a time. [1, L]."""
    total, nll_sum = ids.shape[1], 0.0
    for start in range(0, total, PPL_CHUNK):
        chunk = ids[:, start:start + PPL_CHUNK]
        mask = torch.ones_like(ids[:, :start + chunk.shape[1]])
        positions = torch.arange(start, start + chunk.shape[1], device=ids.device)[None]
        out = model(input_ids=chunk, attention_mask=mask, position_ids=positions, cache=cache,
                    use_cache=True)
        logprobs = torch.log_softmax(out.logits.float(), dim=-1)  # [1, C, V]
        targets = ids[:, start + 1:start + chunk.shape[1] + 1]  # the last chunk has one target fewer
        nll_sum -= float(logprobs[:, :targets.shape[1]].gather(-1, targets[..., None]).sum())
    return nll_sum / (total - 1)


def kl_divergence(ref_logprobs: torch.Tensor, cand_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(reference ‖ candidate) per position, nats. [..., V] → [...]."""
    return (ref_logprobs.exp() * (ref_logprobs - cand_logprobs)).sum(-1)


def compare(reference: ProbeRun, candidate: ProbeRun) -> dict:
    """The gate metrics of a candidate against the reference."""
    step_kl = kl_divergence(reference.step_logprobs, candidate.step_logprobs).flatten()
    needle_kl = kl_divergence(reference.needle_logprobs, candidate.needle_logprobs)
    return {
        "delta_nll": candidate.step_nll - reference.step_nll,
        "ppl_ratio": math.exp(candidate.ppl_nll - reference.ppl_nll),
        "mean_kl": float(torch.cat([step_kl, needle_kl]).mean()),
        "needle_kl": float(needle_kl.mean()),
        "top1_agreement": float((reference.step_logprobs.argmax(-1) == candidate.step_logprobs.argmax(-1))
                                .float().mean()),
        "needle_found": candidate.needle_found,
        "needle_found_reference": reference.needle_found,
        "nll": candidate.step_nll,
        "ppl": math.exp(candidate.ppl_nll),
        "measured_bytes_per_token": candidate.bytes_per_token,
    }


@torch.inference_mode()
def planned_nll(model, ids: torch.Tensor, prompt_len: int, plan: DecodePlan, kind: str | None = None) -> float:
    """The decode-time quality of a decode plan: prefill ids[:, :prompt_len] as planned, then feed the rest one token
    at a time through the planned cache; mean NLL (nats) of each true next token predicted during decoding. [1,T]."""
    cache = make_planned_cache(kind, model, plan)
    ones = torch.ones_like(ids)
    logits, mask, _ = prefill(model, ids[:, :prompt_len], None, ones[:, :prompt_len],
                              torch.arange(prompt_len, device=ids.device)[None], cache, plan.q_chunk)
    nll = []
    for pos in range(prompt_len, ids.shape[1]):
        nll.append(-torch.log_softmax(logits.float(), dim=-1)[0, ids[0, pos]])
        if pos + 1 < ids.shape[1]:
            mask = torch.cat([mask, ones[:, :1]], dim=1)
            logits = decode_one_token(model, ids[:, pos], mask, torch.tensor([pos], device=ids.device), cache)
            mask = trim_mask(mask, cache)
    return float(torch.stack(nll).mean())
