"""The reference engine's steps for hybrid models (sliding windows, linear attention).

A hybrid model's request runs the dense engine's five steps with these differences:

- KV buffer: only attention layers have rows, full layers first, then sliding ones
  (``LayerPlan.rows``), so each group's pages are one view of the buffer.
- lookup and load: :class:`~kvpool.cache.hybrid.HybridCache` finds the longest prefix
  with every full page, the window pages before its end and a state checkpoint at it;
  the full pages and the window pages (only those) are copied into the buffer, and the
  linear layers start from a copy of the checkpoint (the stored one is never written).
- prefill: with linear layers, the prompt runs in pieces that end at every checkpoint
  boundary (``checkpoint_pages`` pages), and the state after each piece is kept: a
  state exists only at the position it was taken. A piece boundary changes nothing but
  where the computation pauses (the attention of each piece sees the whole prefix; the
  delta rule's chunks of 64 tokens stay aligned when a checkpoint spans a multiple).
- store: full pages, the window pages this request holds right (from the first one it
  loaded or computed), and the checkpoints it took.
"""

from __future__ import annotations

import math
import time

import torch
from transformers import DynamicCache

from kvpool.cache import max_reusable_pages
from kvpool.engine.kv import InPlaceLayer, InPlaceSlidingLayer, page_shape, pages_view
from kvpool.engine.layers import FULL, LINEAR, SLIDING, LayerPlan, restore, snapshot

DEFAULT_CHECKPOINT_PAGES = 4  # 64 tokens at page 16: one chunk of the delta rule


class HybridSteps:
    """Load, prefill and store of one request of a hybrid model (see module doc).

    Args:
        plan: the model's :class:`LayerPlan`.
        config: its transformers config.
    """

    def __init__(self, plan: LayerPlan, config):
        self.plan, self.config = plan, config
        self.num_full, self.num_window = plan.count(FULL), plan.count(SLIDING)

    def group_shapes(self, page_size: int) -> tuple[tuple | None, tuple | None]:
        """Page shapes ``(L_group, 2, H_kv, P, D)`` of the full and the sliding layers
        (None for a group the model lacks)."""
        _, two, heads, _, dim = page_shape(self.config, page_size)
        return tuple((n, two, heads, page_size, dim) if n else None
                     for n in (self.num_full, self.num_window))

    def buffer_shape(self) -> tuple[int, int, int, int, int]:
        """One-token page shape of the engine's KV buffer (its attention rows)."""
        _, two, heads, _, dim = page_shape(self.config, 1)
        return (len(self.plan.rows), two, heads, 1, dim)

    def build_cache(self, ns, dtype: torch.dtype, page_size: int, l1_bytes: int, l3,
                    checkpoint_pages: int = DEFAULT_CHECKPOINT_PAGES):
        """A HybridCache whose L1 parts share ``l1_bytes`` by what one page costs."""
        from kvpool.cache.hybrid import HybridCache

        full, window = self.group_shapes(page_size)
        item = torch.empty((), dtype=dtype).element_size()
        state_item = (torch.empty((), dtype=self.plan.state_dtype).element_size()
                      if self.plan.state_parts else 0)
        per_page = (sum(math.prod(s) * item for s in (full, window) if s)
                    + self.plan.state_numel * state_item / checkpoint_pages)
        pages = max(1, int(l1_bytes // per_page))
        return HybridCache(ns, full, window, self.plan.window, self.plan.state_numel,
                           dtype, self.plan.state_dtype, checkpoint_pages, l1_pages=pages,
                           l1_window_pages=pages, l1_checkpoints=pages // checkpoint_pages + 1,
                           l3=l3)

    def new_cache(self, seq: torch.Tensor, length: int, state: torch.Tensor | None
                  ) -> DynamicCache:
        """A transformers cache holding the first ``length`` tokens: attention layers
        over their rows of ``seq`` (written in place), linear layers fresh or started
        from a copy of checkpoint ``state``."""
        cache = DynamicCache(config=self.config)
        row = {layer: r for r, layer in enumerate(self.plan.rows)}
        for i, kind in enumerate(self.plan.kinds):
            if kind == FULL:
                cache.layers[i] = InPlaceLayer(seq[row[i], 0], seq[row[i], 1], length)
            elif kind == SLIDING:
                cache.layers[i] = InPlaceSlidingLayer(seq[row[i], 0], seq[row[i], 1], length,
                                                      self.plan.window)
        if state is not None:
            restore(self.plan, cache, state)
        return cache

    def load_prefix(self, cache, prompt_ids: list[int], seq: torch.Tensor, timings: dict
                    ) -> tuple[DynamicCache, dict[str, int], int, int, torch.Tensor | None]:
        """Match and load. Returns (transformers cache, reused tokens per tier, reused
        tokens, first window page held, the checkpoint it started from or None)."""
        if cache is None:
            return self.new_cache(seq, 0, None), {}, 0, 0, None
        page = cache.page_size
        mark = time.perf_counter()
        match = cache.match(prompt_ids, max_pages=max_reusable_pages(len(prompt_ids), page))
        timings["lookup"] = (time.perf_counter() - mark) * 1e3
        mark = time.perf_counter()
        state = None
        try:
            n = match.num_pages
            if n:
                full = pages_view(seq[:self.num_full], n, page) if self.num_full else None
                window = (pages_view(seq[self.num_full:], n, page)[match.window_first:]
                          if self.num_window else None)
                state = cache.load(match, full_out=full, window_out=window, adopt=False).state
        finally:
            cache.release(match)
        n = match.num_pages  # 0 when a part was gone or failed its check
        kv = self.new_cache(seq, n * page, state)
        timings["load"] = (time.perf_counter() - mark) * 1e3
        return kv, match.tokens_by_tier(), n * page, match.window_first if n else 0, state

    def prefill(self, forward, prompt_ids: list[int], reused: int, kv: DynamicCache, cache
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run the prompt after ``reused`` tokens; returns the last position's logits and
        the checkpoints taken ``{pages: state}`` (none without a cache or linear layers).
        ``forward(ids, past, kv)`` is the engine's forward."""
        if cache is None or LINEAR not in self.plan.kinds:
            return forward(prompt_ids[reused:], reused, kv), {}
        step = cache.checkpoint_pages * cache.page_size
        end = len(prompt_ids) // cache.page_size * cache.page_size
        checkpoints, pos = {}, reused
        for bound in range(reused - reused % step + step, end + 1, step):
            if bound == len(prompt_ids):
                break  # the last piece ends here: taken after it
            forward(prompt_ids[pos:bound], pos, kv)
            checkpoints[bound // cache.page_size] = snapshot(self.plan, kv)
            pos = bound
        logits = forward(prompt_ids[pos:], pos, kv)
        if len(prompt_ids) == end and end % step == 0 and end > reused:
            checkpoints[end // cache.page_size] = snapshot(self.plan, kv)
        return logits, checkpoints

    def store(self, cache, prompt_ids: list[int], seq: torch.Tensor, window_first: int,
              checkpoints: dict[int, torch.Tensor]) -> None:
        """Insert the prompt's full pages, its window pages from ``window_first`` (the
        older rows of the buffer were not loaded) and ``checkpoints``."""
        page = cache.page_size
        full = len(prompt_ids) // page
        if not full:
            return
        full_pages = pages_view(seq[:self.num_full], full, page) if self.num_full else None
        window = (pages_view(seq[self.num_full:], full, page)[window_first:]
                  if self.num_window else None)
        cache.insert(prompt_ids[:full * page], full_pages, window, window_first, checkpoints)
