"""The reference engine: greedy generation on HF transformers with prefix-KV reuse.

One request runs in five steps (issue 2):

1. lookup: the longest cached prefix of the prompt, in full pages, from the prefix
   cache (L1, then L3). The match is taken over ``prompt[:-1]`` so that at least one
   token is always computed: the engine needs the last position's logits (case K15).
2. load: the matched pages are copied once, straight into the request's KV storage in
   the layout transformers reads (``[L, 2, 1, H_kv, T, D]``, kept across requests);
   L3 pages are read into one staging array and checked there (cache.load).
3. prefill: the rest of the prompt runs with position ids starting after the prefix and
   an attention mask covering prefix plus new tokens (transformers 5.x derives the
   causal mask from the cache length and the position ids; ``cache_position`` is gone).
4. decode: greedy, one token at a time, until ``max_new_tokens`` or end of sequence.
5. store: every full page of the prompt is inserted as a view of that storage; the
   cache copies the pages it lacks into L1 and backs up to L3 what L3 lacks.

The cache's layers write new tokens in place (kv.InPlaceLayer), not by concatenating
the whole cache at every forward as transformers' DynamicLayer does.

Hybrid models (sliding-window or linear-attention layers, :mod:`kvpool.engine.layers`)
take the same steps through :mod:`kvpool.engine.hybrid` and a
:class:`~kvpool.cache.hybrid.HybridCache`: window pages and state checkpoints beside
the full-attention pages.

Attention runs the ``kvpool_causal`` kernel (:mod:`kvpool.engine.attention`) by default:
after a cached prefix it computes only the causal pairs, where transformers' stock
``sdpa`` path computes the whole (new tokens x all tokens) rectangle; ``attention="sdpa"``
selects the stock path for comparison.

TTFT is the wall time from the start of ``generate`` to the first output token,
including lookup and load. With fp32, reuse matches a one-shot cold prefill within
1e-4 on the logits (DESIGN.md measured 3e-5) and gives the same greedy tokens.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
from transformers import DynamicCache

from kvpool.cache import max_reusable_pages
from kvpool.engine import attention as attn
from kvpool.engine.hybrid import DEFAULT_CHECKPOINT_PAGES, HybridSteps
from kvpool.engine.kv import kv_buffer, page_shape, pages_view, seq_cache
from kvpool.engine.layers import layer_plan
from kvpool.engine.models import LoadedModel, load_model
from kvpool.errors import InvalidParams

KV_BUFFER_STEP = 1024  # tokens: the engine's KV buffer grows by whole steps


@dataclasses.dataclass
class GenerateResult:
    """Outcome of one request.

    Fields:
        output_ids: generated token ids (greedy; ends with EOS when one was produced).
        prompt_tokens: prompt length in tokens.
        reused_tokens: prompt tokens whose KV came from the cache (a multiple of page_size).
        reused_by_tier: tokens reused per tier, e.g. {"L1": 2048, "L3": 512}: the pages the
            cache's load returned (an L3 page gone or refused when read is not among
            them), as the cache's ``hit_tokens_<tier>`` counters count them.
        ttft_ms: request start to first token, lookup and load included (ms).
        decode_tok_s: tokens per second after the first token (0.0 when only one).
        last_logits: fp32 logits ``[vocab]`` at the last prompt position (CPU tensor).
        timings_ms: {"lookup", "load", "prefill", "decode", "store"} in ms.
    """

    output_ids: list[int]
    prompt_tokens: int
    reused_tokens: int
    reused_by_tier: dict[str, int]
    ttft_ms: float
    decode_tok_s: float
    last_logits: torch.Tensor
    timings_ms: dict[str, float]


class Engine:
    """Greedy generation for one sequence at a time, reusing prefix KV pages.

    Args:
        model: a :class:`LoadedModel`, or a ``--model`` spec for :func:`load_model`.
        dtype: weights and KV dtype when ``model`` is a spec ("float32" is the reference).
        cache: a ``kvpool.cache.PrefixCache`` whose page shape is :meth:`page_shape`
            of its page size, or None to always prefill cold. It can be set later.
        attention: "kvpool_causal" (default: skips the masked pairs after a prefix) or
            "sdpa" (transformers' stock kernel). A model with non-causal or windowed
            layers always gets "sdpa" (``self.attention`` says which runs).
    Raises: InvalidParams for an unknown ``attention``.
    """

    def __init__(self, model: LoadedModel | str = "smollm2", dtype: str = "float32",
                 cache=None, attention: str = attn.NAME):
        if attention not in attn.CHOICES:
            raise InvalidParams(f"attention must be one of {attn.CHOICES}, got {attention!r}")
        self.loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype)
        self.model = self.loaded.model
        self.config = self.model.config
        self.cache = cache
        self._seq: torch.Tensor | None = None  # KV storage reused across requests
        plan = layer_plan(self.model)
        self.hybrid = None if plan.dense else HybridSteps(plan, self.config)
        if attention == attn.NAME:
            attn.register()
        self.attention = attention if attn.supports(self.config) else attn.STOCK
        eos = self.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    def page_shape(self, page_size: int) -> tuple[int, int, int, int, int]:
        """``(L, 2, H_kv, page_size, D)`` of this model's pages (a hybrid model: of its
        full-attention layers, or of its window layers when it has none)."""
        if self.hybrid is not None:
            full, window = self.hybrid.group_shapes(page_size)
            return full or window
        return page_shape(self.config, page_size)

    def namespace(self, page_size: int = 16, cache_salt: str = ""):
        """The cache namespace of this model: name, weights fingerprint, dtype, page size
        (and for a hybrid model its layer layout, in ``extra``)."""
        from kvpool.cache import Namespace

        extra = (self.hybrid.plan.describe(),) if self.hybrid is not None else ()
        return Namespace(model=self.loaded.name, weights_fingerprint=self.loaded.fingerprint,
                         dtype=self.loaded.dtype, page_size=page_size,
                         kv_layout="layer_first", cache_salt=cache_salt, extra=extra)

    def build_cache(self, page_size: int = 16, l1_bytes: int = 1 << 30, l3=None,
                    cache_salt: str = "", checkpoint_pages: int = DEFAULT_CHECKPOINT_PAGES):
        """A PrefixCache for this model's pages (a HybridCache for a hybrid model),
        attached to the engine and returned.

        Args:
            page_size: tokens per page.
            l1_bytes: size of the in-process L1 page pool in bytes (rounded down to pages).
            l3: an L3 backend (``StoreBackend(client)``, ``DiskBackend``) or None.
            checkpoint_pages: a hybrid model's pages between state checkpoints.
        """
        from kvpool.cache import PrefixCache

        if self.hybrid is not None:
            self.cache = self.hybrid.build_cache(self.namespace(page_size, cache_salt),
                                                 self.model.dtype, page_size, l1_bytes, l3,
                                                 checkpoint_pages)
            return self.cache
        shape = self.page_shape(page_size)
        page_bytes = math.prod(shape) * self.model.dtype.itemsize
        self.cache = PrefixCache(self.namespace(page_size, cache_salt), shape,
                                 dtype=self.model.dtype,
                                 l1_pages=max(1, l1_bytes // page_bytes), l3=l3)
        return self.cache

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int = 32,
                 use_cache: bool = True) -> GenerateResult:
        """Generate greedily after ``prompt_ids``; ``use_cache=False`` forces a cold run.

        Raises: InvalidParams on an empty prompt, a token id outside the vocabulary or
        ``max_new_tokens < 1``.
        """
        if not prompt_ids:
            raise InvalidParams("empty prompt")
        vocab = self.model.get_input_embeddings().num_embeddings
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InvalidParams(f"token ids must be in [0, {vocab})")
        if max_new_tokens < 1:
            raise InvalidParams(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        cache = self.cache if use_cache else None
        if self.config._attn_implementation != self.attention:
            # the kernel is a setting of the model object, which engines may share
            self.model.set_attn_implementation(self.attention)
        timings = dict.fromkeys(("lookup", "load", "prefill", "decode", "store"), 0.0)
        start = time.perf_counter()
        seq = self.sequence_buffer(len(prompt_ids) + max_new_tokens)
        if self.hybrid is None:
            kv, by_tier = self.load_prefix(cache, prompt_ids, seq, timings)
            reused = kv.get_seq_length()
            mark = time.perf_counter()
            logits = self._forward(prompt_ids[reused:], reused, kv)
        else:
            kv, by_tier, reused, window_first, state = self.hybrid.load_prefix(
                cache, prompt_ids, seq, timings)
            mark = time.perf_counter()
            logits, checkpoints = self.hybrid.prefill(self._forward, prompt_ids, reused, kv,
                                                      cache)
            if state is not None:  # back into L1 when it came from L3
                checkpoints[reused // cache.page_size] = state
        first = int(logits.argmax())
        now = time.perf_counter()
        timings["prefill"] = (now - mark) * 1e3
        ttft_ms = (now - start) * 1e3

        output = self._decode(first, len(prompt_ids), kv, max_new_tokens)
        timings["decode"] = (time.perf_counter() - now) * 1e3
        if cache is not None:
            mark = time.perf_counter()
            if self.hybrid is None:
                self._store(cache, prompt_ids, seq)
            else:
                self.hybrid.store(cache, prompt_ids, seq, window_first, checkpoints)
            timings["store"] = (time.perf_counter() - mark) * 1e3
        decoded = len(output) - 1
        return GenerateResult(
            output_ids=output, prompt_tokens=len(prompt_ids), reused_tokens=reused,
            reused_by_tier=by_tier, ttft_ms=ttft_ms,
            decode_tok_s=decoded / (timings["decode"] / 1e3) if decoded else 0.0,
            last_logits=logits.float(), timings_ms=timings)

    def sequence_buffer(self, capacity: int) -> torch.Tensor:
        """KV storage ``[L, 2, 1, H_kv, >= capacity, D]`` for one request (a hybrid
        model: one row per attention layer, full layers first).

        Kept from one request to the next (one request at a time) and grown to the
        largest seen, in steps of KV_BUFFER_STEP tokens (a conversation grows by a
        turn at a time): fresh memory costs a page fault per 4 KiB on first touch,
        ~35 ms per 100 MB here, on the path to the first token.
        """
        if self._seq is None or self._seq.shape[4] < capacity:
            self._seq = None  # free the old one first
            capacity = -(-capacity // KV_BUFFER_STEP) * KV_BUFFER_STEP
            rows = (self.hybrid.buffer_shape() if self.hybrid is not None
                    else page_shape(self.config, 1))
            self._seq = kv_buffer(rows, capacity, self.model.dtype)
        return self._seq

    def reserve(self, tokens: int) -> None:
        """Allocate and touch, now, what a request of up to ``tokens`` tokens writes on
        its way to the first token: the KV buffer (:meth:`sequence_buffer`) and the
        cache's L3 read rows (:meth:`PrefixCache.reserve`, at most 8 MiB: loads go in
        chunks), about ``tokens`` x the KV bytes of a token (SmolLM2-135M in fp32: 46 KB). Call at start, before serving:
        the first request otherwise pays their page faults (and, on a VM, the host
        backing fresh memory) in its time to first token."""
        if tokens <= 0:
            return
        self.sequence_buffer(tokens).zero_()
        if self.cache is not None:
            self.cache.reserve(-(-tokens // self.cache.page_size))

    def load_prefix(self, cache, prompt_ids, seq, timings
                     ) -> tuple[DynamicCache, dict[str, int]]:
        """The KV of the longest reusable cached prefix, as a cache over ``seq`` (see
        :meth:`sequence_buffer`), and the reused tokens per tier."""
        if cache is None:
            return seq_cache(seq, 0, self.config), {}
        mark = time.perf_counter()
        # never the whole prompt: the last token is always computed (K15)
        match = cache.match(prompt_ids, max_pages=max_reusable_pages(len(prompt_ids),
                                                                     cache.page_size))
        timings["lookup"] = (time.perf_counter() - mark) * 1e3
        mark = time.perf_counter()
        try:
            if match.num_pages:
                # each page is copied once, straight into the model's KV layout; load may
                # cut the match at a page that is gone or fails its check (a miss)
                view = pages_view(seq, match.num_pages, cache.page_size)
                if cache.dtype == seq.dtype:
                    # L3 pages reach L1 when _store inserts them, after the first token
                    cache.load(match, out=view, adopt=False)
                else:
                    pages = cache.load(match)
                    view[:match.num_pages].copy_(pages)
        finally:
            cache.release(match)
        kv = seq_cache(seq, match.num_tokens, self.config)
        timings["load"] = (time.perf_counter() - mark) * 1e3
        # after load: only the pages it returned, as the cache's hit counters count them
        return kv, match.tokens_by_tier()

    def _forward(self, ids: list[int], past: int, kv: DynamicCache) -> torch.Tensor:
        """Run ``ids`` at positions ``past..past+len-1``; returns the last position's logits."""
        n = len(ids)
        out = self.model(
            input_ids=torch.tensor([ids], dtype=torch.long),
            position_ids=torch.arange(past, past + n, dtype=torch.long)[None],
            attention_mask=torch.ones(1, past + n, dtype=torch.long),
            cache=kv, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def _decode(self, first: int, prompt_len: int, kv: DynamicCache, max_new: int) -> list[int]:
        output = [first]
        while len(output) < max_new and output[-1] not in self.eos_ids:
            logits = self._forward([output[-1]], prompt_len + len(output) - 1, kv)
            output.append(int(logits.argmax()))
        return output

    def _store(self, cache, prompt_ids: list[int], seq: torch.Tensor) -> None:
        """Insert every full page of the prompt (the cache copies only the pages it
        lacks, straight out of ``seq``, and backs up to L3 only what L3 lacks)."""
        page_size = cache.page_size
        full = len(prompt_ids) // page_size
        if full:
            pages = pages_view(seq, full, page_size)
            if pages.dtype != cache.dtype:
                pages = pages.to(cache.dtype)
            cache.insert(prompt_ids[:full * page_size], pages)
