"""The static-batching baseline (seed 003's `max_batch_size` + `max_wait_ms`): our Generator fed fixed batches.

A batch starts when the generator is idle and either `max_batch_size` requests wait or the oldest has waited
`max_wait_ms`; it decodes to the end of its longest request (rows that are done ride along, as in any static
batch), and the next batch waits for it. Each row's own stop rules are applied to what the Generator yields
(EOS once `min_new_tokens` are out, its `max_new_tokens`), so the records say what each request got and when,
exactly as the continuous scheduler's do. Greedy rows equal their solo decode up to left padding's float rounding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import torch

from runner.infer.config.decoding import GenerateConfig
from runner.infer.decode.forward import eos_ids
from runner.infer.generation.generator import Generator
from runner.infer.serve.requests import Request, RequestRecord


def serve_static(model, requests: Iterable[Request], clock: Callable[[], float], sleep: Callable[[float], None],
                 max_batch_size: int = 8, max_wait_ms: float = 50.0,
                 sampling: GenerateConfig | None = None) -> list[RequestRecord]:
    """Release each request at its `arrival_s`, decode fixed batches as they fill → the records, in request order."""
    sampling = sampling or GenerateConfig(temperature=0.0)
    eos = eos_ids(model, sampling.eos_token_id)
    requests = list(requests)
    records = {r.id: RequestRecord(r.id, r.arrival_s, len(r.prompt_ids)) for r in requests}
    pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.id)))
    queue: deque[Request] = deque()
    while pending or queue:
        now = clock()
        while pending and pending[0].arrival_s <= now:
            queue.append(pending.popleft())
        due = queue[0].arrival_s + max_wait_ms / 1000 if queue else float("inf")
        if len(queue) >= max_batch_size or (queue and now >= due):
            batch = [queue.popleft() for _ in range(min(max_batch_size, len(queue)))]
            _decode_batch(model, batch, [records[r.id] for r in batch], sampling, eos, clock)
        else:
            sleep(max(0.0, min(due, pending[0].arrival_s if pending else due) - now))
    return list(records.values())


def _decode_batch(model, batch: list[Request], records: list[RequestRecord], sampling: GenerateConfig,
                  eos: set[int], clock: Callable[[], float]) -> None:
    """One static batch, left-padded; every row's tokens and their times recorded until its own stop."""
    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)  # [B,T] left-padded
    mask = torch.zeros_like(ids)
    for row, request in enumerate(batch):
        ids[row, width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids)
        mask[row, width - len(request.prompt_ids):] = 1
    config = sampling.model_copy(update={"max_new_tokens": max(r.max_new_tokens for r in batch),
                                         "eos_token_id": []})  # each row's own EOS rule below
    start = clock()
    for record in records:
        record.scheduled_s = start
    for token in Generator(model, config).steps(ids, mask):
        now = clock()
        for row, (request, record) in enumerate(zip(batch, records)):
            if record.finish:
                continue
            record.output_ids.append(int(token[row]))
            record.token_s.append(now)
            n = len(record.output_ids)
            if int(token[row]) in eos and n >= request.min_new_tokens:
                record.finish = "eos"
            elif n >= request.max_new_tokens:
                record.finish = "length"
        if all(record.finish for record in records):
            break
