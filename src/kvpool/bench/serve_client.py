"""The load generator of ``kvpool bench serve``: requests at their arrival times, each
streamed from vLLM's OpenAI server, timed from the stream.

Every request is a streaming ``/v1/completions`` call with the prompt as token ids,
greedy, ``ignore_eos`` (all ``max_tokens`` are generated) and the run's
``cache_salt``. TTFT is the time from sending to the first streamed chunk; ITL the gaps
between chunks (one token each, vLLM's default stream interval); TPOT, as in
``vllm bench serve``, ``(last chunk − first chunk) / (output tokens − 1)``. vLLM's
usage record gives the prompt tokens and how many of them were cached (local prefix
cache and connector together, ``--enable-prompt-tokens-details``).

Goodput, as ``vllm bench serve --goodput`` defines it: requests that met every SLO
(TTFT and TPOT) per second of the run, the run lasting from the first arrival to the
last completion.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import numpy as np

from kvpool.bench.serve_router import Router
from kvpool.bench.serve_workloads import ServeRequest

KEEPALIVE_S = 2.0  # seconds an idle connection to a server is kept: under the server's own keep-alive


@dataclasses.dataclass
class Outcome:
    """What one request measured (seconds); ``error`` is set when it failed."""

    index: int
    instance: int
    sent_s: float
    ttft_s: float | None = None
    chunk_s: list = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2 or len(self.chunk_s) < 2:
            return None
        return (self.chunk_s[-1] - self.chunk_s[0]) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        return np.diff(self.chunk_s).tolist() if len(self.chunk_s) > 1 else []

    def good(self, slo_ttft_s: float, slo_tpot_s: float) -> bool:
        tpot = self.tpot_s
        return (self.error is None and self.ttft_s is not None and self.ttft_s <= slo_ttft_s
                and (tpot is None or tpot <= slo_tpot_s))


async def _stream(session, url: str, model: str, req: ServeRequest, salt: str,
                  out: Outcome, timeout_s: float) -> None:
    import aiohttp

    body = {"model": model, "prompt": list(req.prompt), "max_tokens": req.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if salt:
        body["cache_salt"] = salt
    t0 = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if obj.get("choices"):
                out.chunk_s.append(time.perf_counter() - t0)
            usage = obj.get("usage")
            if usage:
                out.prompt_tokens = usage.get("prompt_tokens") or 0
                out.output_tokens = usage.get("completion_tokens") or 0
                details = usage.get("prompt_tokens_details") or {}
                out.cached_tokens = details.get("cached_tokens") or 0
    if out.chunk_s:
        out.ttft_s = out.chunk_s[0]
    else:
        out.error = "no token streamed"


async def run_load(urls: list[str], model: str, requests: list[ServeRequest],
                   arrivals: list[float], router: Router, salt: str,
                   timeout_s: float = 600.0) -> tuple[list[Outcome], float]:
    """Send every request at its arrival offset (after its ``after`` request finished),
    to the instance the router picks. Returns the outcomes (request order) and the
    run's duration in seconds."""
    import aiohttp

    loop = asyncio.get_running_loop()
    finished = {r.index: asyncio.Event() for r in requests}
    outcomes: dict[int, Outcome] = {}
    start = time.perf_counter()

    async def one(session, req: ServeRequest, at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        if req.after is not None:
            await finished[req.after].wait()
        if router.policy == "prefix":  # one blocking RPC to the master
            i = await loop.run_in_executor(None, router.pick, req.prompt, salt)
        else:
            i = router.pick(req.prompt, salt)
        out = outcomes[req.index] = Outcome(req.index, i, time.perf_counter() - start)
        router.started(i)
        try:
            await _stream(session, urls[i], model, req, salt, out, timeout_s)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            router.finished(i)
            finished[req.index].set()

    # idle connections are dropped before the server's keep-alive (vLLM: 5 s) closes them:
    # aiohttp keeps them 15 s, and a request sent on one the server had just closed
    # failed as ServerDisconnectedError without reaching it (1 of 12 in a CI run)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(one(session, r, a) for r, a in zip(requests, arrivals)))
    duration = time.perf_counter() - start
    return [outcomes[r.index] for r in requests], duration


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if values else None


def summarize(outcomes: list[Outcome], duration_s: float, slo_ttft_s: float,
              slo_tpot_s: float) -> dict:
    """Throughput, goodput, TTFT / ITL / TPOT percentiles (ms), hit rate of one run."""
    ok = [o for o in outcomes if o.error is None and o.ttft_s is not None]
    good = [o for o in ok if o.good(slo_ttft_s, slo_tpot_s)]
    ttft = [o.ttft_s for o in ok]
    itl = [g for o in ok for g in o.itl_s]
    tpot = [o.tpot_s for o in ok if o.tpot_s is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    return {
        "requests": len(outcomes), "completed": len(ok), "good": len(good),
        # why the others were not good (a request may miss both)
        "missed_ttft": sum(1 for o in ok if o.ttft_s > slo_ttft_s),
        "missed_tpot": sum(1 for o in ok if (o.tpot_s or 0.0) > slo_tpot_s),
        "errors": sorted({o.error for o in outcomes if o.error})[:3],
        "duration_s": duration_s, "throughput_rps": len(ok) / duration_s,
        "goodput_rps": len(good) / duration_s,
        "ttft_ms": {"p50": _pct(ttft, 50), "p90": _pct(ttft, 90), "p99": _pct(ttft, 99)},
        "itl_ms": {"p50": _pct(itl, 50), "p90": _pct(itl, 90), "p99": _pct(itl, 99)},
        "tpot_ms": {"p50": _pct(tpot, 50), "p90": _pct(tpot, 90)},
        "prompt_tokens": prompt, "cached_tokens": sum(o.cached_tokens for o in ok),
        "hit_rate": sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        "per_instance": [sum(1 for o in outcomes if o.instance == i)
                         for i in range(max((o.instance for o in outcomes), default=-1) + 1)],
    }
