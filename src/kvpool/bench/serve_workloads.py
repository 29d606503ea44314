"""The request streams of ``kvpool bench serve``: prompts as token ids, and arrival times.

Three workloads, each a list of :class:`ServeRequest` built once and replayed
unchanged against every configuration:

- ``chat``: multi-turn chat over shared documents. The shipped document (the demo's)
  and others generated from it (its paragraphs in another seeded order) are cut to
  ``doc_tokens``; session ``s`` talks about document ``s % docs``; turn ``t`` is the
  whole conversation so far (system, document and first question, then fixed
  assistant answers and the next questions), so each turn extends the previous one's
  prompt. A turn is sent when it arrives and its previous turn has finished.
- ``system``: one long shared system prompt (the system message and the start of the
  document, ``doc_tokens`` in all), then a distinct short question per request.
- ``trace``: a Mooncake conversation trace (``kvpool bench cache --trace``'s format)
  scaled down: whole conversations (requests sharing their first two hash blocks, the
  later turns extending the earlier ones) of two turns or more, taken in the order they
  start (:func:`conversation_sample`); every 512-token hash block becomes ``block_tokens`` pseudo-random
  token ids drawn from its hash id (the prefix structure is kept: equal ids, equal
  tokens), prompt lengths shrink by the same factor, and the trace's own
  arrival times are kept, stretched so that their mean rate is the offered rate.

``chat`` and ``system`` arrive as a Poisson process (exponential gaps, seeded): the
same seed and rate give the same times for every configuration.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvpool.bench.trace_replay import BLOCK_TOKENS, TraceRequest
from kvpool.engine.workload import chat_prompt_ids, load_workload
from kvpool.errors import UserError

WORKLOADS = ("chat", "system", "trace")
ANSWER = ("Based on the document, the answer is in the section about the canal's early "
          "years; the figures there give the details you asked for.")


@dataclasses.dataclass(frozen=True)
class ServeRequest:
    """One request: ``prompt`` token ids, ``max_tokens`` to generate (all of them:
    the client asks vLLM to ignore EOS), ``after``: index of the request that must
    finish before this one is sent (the previous turn), or None."""

    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    after: int | None = None


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named request list; ``trace_ms``: the trace's arrival times (ms) when the
    workload keeps them, else None (Poisson arrivals)."""

    name: str
    requests: list[ServeRequest]
    trace_ms: list[float] | None = None

    def arrivals(self, rate: float, seed: int = 0) -> list[float]:
        """Arrival offsets in seconds at ``rate`` requests/s (module docstring)."""
        if not rate > 0:
            raise UserError(f"offered rate must be > 0 requests/s, got {rate:g}")
        n = len(self.requests)
        if self.trace_ms is not None and n > 1 and self.trace_ms[-1] > self.trace_ms[0]:
            t = np.asarray(self.trace_ms, dtype=float) - self.trace_ms[0]
            return (t * ((n - 1) / t[-1]) / rate).tolist()
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
        gaps[0] = 0.0
        return np.cumsum(gaps).tolist()

    def typical_request(self) -> ServeRequest:
        """The request whose prompt length is nearest the mean (the calibration request):
        a request's cost grows with its prompt, so the mean, not the median, sizes what
        the workload asks of the servers (a trace's long turns pull the mean up)."""
        mean = sum(len(r.prompt) for r in self.requests) / len(self.requests)
        return min(self.requests, key=lambda r: abs(len(r.prompt) - mean))


def _documents(tokenizer, docs: int, doc_tokens: int) -> list[str]:
    """The shipped document and ``docs - 1`` reorderings of its paragraphs, each cut to
    ``doc_tokens`` tokens (decoded back to text)."""
    text = load_workload()["document"]
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    out = []
    for d in range(docs):
        order = (np.arange(len(paragraphs)) if d == 0
                 else np.random.default_rng(d).permutation(len(paragraphs)))
        ids = tokenizer("\n\n".join(paragraphs[i] for i in order),
                        add_special_tokens=False)["input_ids"]
        out.append(tokenizer.decode(ids[:doc_tokens]))
    return out


def chat_workload(tokenizer, sessions: int, turns: int, docs: int, doc_tokens: int,
                  max_tokens: int) -> Workload:
    """Multi-turn chat over shared documents; requests ordered turn by turn."""
    spec = load_workload()
    questions = spec["questions"] + [f["text"] for f in spec["follow_ups"]]
    documents = _documents(tokenizer, docs, doc_tokens)
    history = {s: [{"role": "system", "content": spec["system"]}] for s in range(sessions)}
    last: dict[int, int] = {}
    requests = []
    for t in range(turns):
        for s in range(sessions):
            q = questions[(s + t) % len(questions)]
            if t == 0:
                content = f"Read this document.\n\n{documents[s % docs]}\n\nQuestion: {q}"
            else:
                history[s].append({"role": "assistant", "content": ANSWER})
                content = q
            history[s].append({"role": "user", "content": content})
            ids = chat_prompt_ids(tokenizer, history[s])
            requests.append(ServeRequest(len(requests), tuple(ids), max_tokens, last.get(s)))
            last[s] = len(requests) - 1
    return Workload("chat", requests)


def system_workload(tokenizer, requests: int, doc_tokens: int, max_tokens: int) -> Workload:
    """A shared long system prompt, then a distinct short question per request."""
    spec = load_workload()
    system = f"{spec['system']}\n\nReference material:\n\n{_documents(tokenizer, 1, doc_tokens)[0]}"
    out = []
    for i in range(requests):
        q = f"(user {i}) {spec['questions'][i % len(spec['questions'])]}"
        ids = chat_prompt_ids(tokenizer, [{"role": "system", "content": system},
                                          {"role": "user", "content": q}])
        out.append(ServeRequest(i, tuple(ids), max_tokens))
    return Workload("system", out)


def conversation_sample(trace: list[TraceRequest], limit: int) -> list[TraceRequest]:
    """Whole multi-turn conversations of ``trace``, first started first, at most
    ``limit`` requests, in trace order. A conversation: the requests whose first two
    hash ids agree (block 0 is the trace's shared system block)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(trace):
        groups.setdefault(r.hash_ids[:2], []).append(i)
    chosen: list[int] = []
    for members in groups.values():
        if len(members) >= 2 and len(chosen) + len(members) <= limit:
            chosen += members
    if not chosen:
        raise UserError("the trace has no conversation of two turns or more within the "
                        f"{limit}-request sample")
    return [trace[i] for i in sorted(chosen)]


def trace_workload(trace: list[TraceRequest], vocab: int, block_tokens: int,
                   max_prompt: int, max_tokens: int) -> Workload:
    """A Mooncake trace scaled down by ``block_tokens / 512`` (module docstring); every
    request generates ``max_tokens``. Prompts longer than ``max_prompt`` tokens are
    cut (their prefix structure kept)."""
    scale = block_tokens / BLOCK_TOKENS
    blocks: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:
        if h not in blocks:
            blocks[h] = np.random.default_rng(h).integers(100, vocab - 100, block_tokens).tolist()
        return blocks[h]

    out = []
    for i, req in enumerate(trace):
        n = max(1, min(max_prompt, round(req.input_length * scale)))
        ids = [t for h in req.hash_ids for t in block(h)][:n]
        if len(ids) < n:  # the request's own tail beyond its hashed blocks
            ids += np.random.default_rng(10**9 + i).integers(100, vocab - 100, n - len(ids)).tolist()
        out.append(ServeRequest(i, tuple(ids), max_tokens))
    return Workload("trace", out, [float(r.timestamp) for r in trace])
