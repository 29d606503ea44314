"""Prefix caching for hybrid models: full-attention pages, window pages, state checkpoints.

A hybrid model (Qwen3-Next, Kimi Linear, Jamba: linear attention or Mamba beside full
attention; Gemma, gpt-oss: sliding windows beside full attention) keeps three kinds of
cache, and :class:`HybridCache` stores each by what a later hit needs:

    full     softmax attention over every earlier token: the KV of those layers in
             pages, in a :class:`~kvpool.cache.prefix_cache.PrefixCache` (radix tree,
             L1/L2/L3), exactly as for a dense model; a hit needs every page before it.
    window   sliding-window layers (window ``W``: a token sees itself and ``W - 1``
             predecessors): the KV of those layers per page, in a
             :class:`~kvpool.cache.parts.PartStore` ("window"); a hit at token ``t``
             needs only the pages holding tokens ``[t - W + 1, t)``.
    state    linear-attention / SSM layers: one recurrent state and the last ``K - 1``
             convolution inputs per layer, valid only at the exact position they were
             taken. A checkpoint of all of them (one object: K17) is stored every
             ``checkpoint_pages`` pages, keyed by the key of the page that ends there,
             in a PartStore ("state"); a hit must end at a checkpoint.

So a hit of ``h`` pages needs full pages ``0..h-1``, window pages ``first..h-1`` and,
with state layers, a checkpoint at ``h`` (``h`` a multiple of ``checkpoint_pages``). The
match is the longest such ``h``; the tokens between it and the longest prefix whose KV
was there are counted as lost to checkpoint spacing (``checkpoint_lost_tokens``).

Every object carries the page header of :mod:`kvpool.cache.codec` (namespace digest,
key bound to its part, page number, length, checksum); one that fails is a miss. A
checkpoint is copied out to the caller (copy-on-write): the request that continues
from it updates its own copy, never the stored one nor another request's.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import torch

from kvpool.cache.keys import PageChain, page_chain
from kvpool.cache.l3 import L3Backend
from kvpool.cache.match import Match
from kvpool.cache.metrics import CacheMetrics
from kvpool.cache.namespace import Namespace
from kvpool.cache.parts import PartStore
from kvpool.cache.prefix_cache import PrefixCache
from kvpool.cache.tree import Tier
from kvpool.errors import InvalidParams

WINDOW, STATE = "window", "state"


def window_first_page(hit_pages: int, window: int, page_size: int) -> int:
    """First page a sliding-window layer needs for a hit of ``hit_pages`` pages: the one
    holding token ``hit_pages * page_size - (window - 1)`` (0 when the window reaches
    back to the start). ``window``: tokens a query sees, itself included (transformers'
    ``sliding_window``: key ``k`` is seen by query ``q`` when ``q - window < k <= q``)."""
    return max(0, hit_pages * page_size - (window - 1)) // page_size


def trailing_pages(window: int, page_size: int) -> int:
    """Pages a sliding-window layer needs before a hit point: ``ceil((window - 1) / P)``
    (:func:`window_first_page` is ``hit - trailing``, 0 at the least)."""
    return -(-(window - 1) // page_size)


def restorable_prefixes(kv_pages: int, pools: Sequence[tuple[int | None, Sequence[bool]]]
                        ) -> list[int]:
    """The prefix lengths ``h`` in ``1..kv_pages`` (ascending) that every pool can
    restore. A pool is ``(trailing, present)``, ``present[i]`` saying whether the pool
    holds page ``i``: ``trailing=None`` needs every page before ``h`` (SGLang's
    ALL_PAGES), ``trailing=n`` only the last ``n`` (TRAILING_PAGES: a window, or with
    ``n = 1`` a state taken at ``h``; a pool absent at ``h - 1`` cannot stop there).
    The per-pool rule is SGLang HiCache's ``batch_exists_v2`` hit policies'."""
    ok = list(range(1, kv_pages + 1))
    for trailing, present in pools:
        if trailing is None:
            lead = next((i for i in range(kv_pages) if not present[i]), kv_pages)
            ok = [h for h in ok if h <= lead]
        else:
            ok = [h for h in ok if all(present[max(0, h - trailing):h])]
    return ok


@dataclasses.dataclass(eq=False)
class HybridMatch:
    """The cached prefix of one prompt for a hybrid model.

    Attributes:
        num_pages: pages of the hit (0 after a failed :meth:`HybridCache.load`).
        page_size: tokens per page.
        full: the match of the full-attention pages (None without such layers).
        window_first: first page whose window KV is loaded (earlier ones are not needed).
        lost_tokens: tokens whose KV was cached but that lie after the last checkpoint
            (recomputed because the state is only known at checkpoints).
        tiers: per page of the hit, the tier its full (else window) KV was found in.
        chain: the prompt's page chain.
        held: L1 entries locked per part until :meth:`HybridCache.release`.
    """

    num_pages: int
    page_size: int
    full: Match | None
    window_first: int
    lost_tokens: int
    tiers: list[Tier]
    chain: PageChain
    held: dict[str, list[bytes]]
    released: bool = False

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def tokens_by_tier(self) -> dict[str, int]:
        """Tokens of the hit per tier, e.g. ``{"L1": 128}`` (plain strings)."""
        by_tier: dict[str, int] = {}
        for tier in self.tiers[:self.num_pages]:
            by_tier[str(tier)] = by_tier.get(str(tier), 0) + self.page_size
        return by_tier


@dataclasses.dataclass
class Loaded:
    """What :meth:`HybridCache.load` delivered for ``num_pages`` pages: full pages
    ``[n, *full_shape]``, window pages ``[n - window_first, *window_shape]`` and the
    checkpoint ``[state_numel]`` (each None when the model has no such layers or the
    hit is empty). The checkpoint is the caller's own copy."""

    full: torch.Tensor | None
    window: torch.Tensor | None
    state: torch.Tensor | None


class HybridCache:
    """Prefix cache of a hybrid model (see module doc).

    Args:
        ns: the namespace (it should name the layer layout: the engine's does).
        full_shape: one page of the full-attention layers, ``(L_full, 2, H, P, D)``, or
            None when there are none.
        window_shape: one page of the sliding-window layers ``(L_win, 2, H, P, D)`` or None.
        window: their window in tokens (transformers' ``sliding_window``).
        state_numel: elements of one checkpoint (every linear layer's recurrent and
            convolution state, flat), 0 when there are no such layers.
        dtype: KV dtype; state_dtype: checkpoint dtype (may differ, e.g. fp32 states).
        checkpoint_pages: pages between checkpoints (> 0).
        l1_pages, l1_window_pages, l1_checkpoints: L1 capacity of each part.
        l3: the L3 backend (every part's objects go there) or None.
        full_options: further PrefixCache arguments for the full pages (l2_pages, ...).

    Raises InvalidParams when no layer group is given or a shape does not fit the
    namespace's page size.
    """

    def __init__(self, ns: Namespace, full_shape: Sequence[int] | None = None,
                 window_shape: Sequence[int] | None = None, window: int = 0,
                 state_numel: int = 0, dtype: torch.dtype = torch.float32,
                 state_dtype: torch.dtype | None = None, checkpoint_pages: int = 4,
                 l1_pages: int = 4096, l1_window_pages: int = 4096, l1_checkpoints: int = 1024,
                 l3: L3Backend | None = None, async_backup: bool = True, **full_options):
        if full_shape is None and window_shape is None and not state_numel:
            raise InvalidParams("a hybrid cache needs full, window or state layers")
        if checkpoint_pages < 1:
            raise InvalidParams(f"checkpoint_pages must be >= 1, got {checkpoint_pages}")
        if window_shape is not None and window < 1:
            raise InvalidParams("window layers need a window of >= 1 token")
        for shape in (full_shape, window_shape):
            if shape is not None and (len(shape) != 5 or shape[3] != ns.page_size):
                raise InvalidParams(f"page shape {tuple(shape)} is not (L, 2, H, "
                                    f"page_size={ns.page_size}, D)")
        self.ns, self.page_size, self.dtype = ns, ns.page_size, dtype
        self.checkpoint_pages, self.window = checkpoint_pages, window
        self._local = threading.local()
        self.full = (PrefixCache(ns, full_shape, dtype, l1_pages, l3, reduce_hits=self._agree,
                                 async_backup=async_backup, **full_options)
                     if full_shape is not None else None)
        self.metrics = self.full.metrics if self.full is not None else CacheMetrics()
        self.windows = (PartStore(ns, WINDOW, window_shape, dtype, l1_window_pages, l3,
                                  self.metrics, async_backup)
                        if window_shape is not None else None)
        self.states = (PartStore(ns, STATE, (state_numel,), state_dtype or dtype,
                                 l1_checkpoints, l3, self.metrics, async_backup)
                       if state_numel else None)

    @property
    def full_shape(self) -> tuple[int, ...] | None:
        return self.full.page_shape if self.full is not None else None

    @property
    def window_shape(self) -> tuple[int, ...] | None:
        return self.windows.shape if self.windows is not None else None

    # -- lookup -----------------------------------------------------------------------
    def match(self, token_ids: Sequence[int] | PageChain, max_pages: int | None = None
              ) -> HybridMatch:
        """Longest usable cached prefix of ``token_ids`` (at most ``max_pages`` pages):
        every full page, the window pages before its end, and a checkpoint at its end.
        Locks what it found in L1 until :meth:`release`."""
        chain = token_ids if isinstance(token_ids, PageChain) else page_chain(self.ns, token_ids)
        if chain.ns_digest != self.ns.digest():
            raise InvalidParams("page chain of another namespace")
        limit = len(chain.keys) if max_pages is None else max(0, min(max_pages, len(chain.keys)))
        self._local.chain, self._local.decision = chain, None
        full = None
        if self.full is not None:
            full = self.full.match(chain, max_pages=limit)  # calls _agree with its page count
        else:
            self._agree(limit)
        hit, first, lost, held, window_tiers = self._local.decision
        self._local.chain = self._local.decision = None
        tiers = full.tiers if full is not None else window_tiers
        m = HybridMatch(hit, self.page_size, full, first, lost, list(tiers[:hit]), chain, held)
        self._count(m)
        return m

    def _agree(self, kv_pages: int) -> int:
        """The hit, given that the first ``kv_pages`` full pages are cached: the largest
        ``h <= kv_pages`` whose window pages and checkpoint are there too. Records the
        decision (and locks its L1 parts) for :meth:`match`."""
        chain: PageChain = self._local.chain
        keys, toks = chain.keys[:kv_pages], chain.tokens[:kv_pages]
        pools, win = [], []
        if self.windows is not None:
            win = self.windows.find(keys, toks)
            pools.append((trailing_pages(self.window, self.page_size),
                          [w is not None for w in win]))
        kv_hit = max(restorable_prefixes(kv_pages, pools), default=0)
        hit = kv_hit
        if self.states is not None:
            at = list(range(self.checkpoint_pages, kv_hit + 1, self.checkpoint_pages))
            found = self.states.find([keys[h - 1] for h in at], [toks[h - 1] for h in at])
            present = [False] * kv_pages
            for h, where in zip(at, found):
                present[h - 1] = where is not None
            pools.append((1, present))
            hit = max(restorable_prefixes(kv_pages, pools), default=0)
        first = (window_first_page(hit, self.window, self.page_size)
                 if self.windows is not None else hit)
        held = {}
        if self.windows is not None and hit:
            held[WINDOW] = self.windows.lock(keys[first:hit])
        if self.states is not None and hit:
            held[STATE] = self.states.lock([keys[hit - 1]])
        # pages before the window are not loaded: they count as the first loaded one's tier
        loaded = win[first:hit]
        window_tiers = [loaded[0] if loaded else Tier.L1] * first + loaded
        self._local.decision = (hit, first, (kv_hit - hit) * self.page_size, held, window_tiers)
        return hit

    def _count(self, m: HybridMatch) -> None:
        self.metrics.inc("hybrid_lookups")
        self.metrics.inc("checkpoint_lost_tokens", m.lost_tokens)
        if m.num_pages and self.states is not None:
            self.metrics.inc("checkpoint_hits")
        if m.num_pages and self.windows is not None:
            self.metrics.inc("window_pages_skipped", m.window_first)

    def load(self, m: HybridMatch, full_out: torch.Tensor | None = None,
             window_out: torch.Tensor | None = None, adopt: bool = True) -> Loaded:
        """Load the hit: full pages (into ``full_out`` ``[n, *full_shape]`` when given),
        window pages of pages ``window_first..n-1`` (into ``window_out``), and a copy of
        the checkpoint. When any part is gone or fails its check, the hit falls back to
        nothing (``m.num_pages = 0``, counted in ``hybrid_fallbacks``): the caller then
        computes the prompt from the start, which is always right.
        Raises InvalidParams for a released match."""
        if m.released:
            raise InvalidParams("load of a released match")
        n = m.num_pages
        if not n:
            return Loaded(None, None, None)
        full = window = state = None
        good = True
        if self.full is not None:
            full = self.full.load(m.full, out=full_out, adopt=adopt)
            good = m.full.num_pages == n
        keys = m.chain.keys
        if good and self.windows is not None:
            window = (window_out if window_out is not None else
                      torch.empty((n - m.window_first, *self.windows.shape), dtype=self.dtype))
            good = self.windows.read(keys[m.window_first:n], range(m.window_first, n), window)
        if good and self.states is not None:
            state = torch.empty(self.states.shape, dtype=self.states.pool.data.dtype)
            good = self.states.read([keys[n - 1]], [n - 1], state.unsqueeze(0))
        if not good:
            self.metrics.inc("hybrid_fallbacks")
            m.num_pages, m.tiers = 0, []
            return Loaded(None, None, None)
        return Loaded(full, window, state)

    def release(self, m: HybridMatch) -> None:
        """Drop the locks taken by :meth:`match` (once per match)."""
        if m.released:
            raise InvalidParams("match released twice")
        m.released = True
        if m.full is not None:
            self.full.release(m.full)
        for part, store in ((WINDOW, self.windows), (STATE, self.states)):
            if part in m.held:
                store.unlock(m.held[part])

    # -- insertion --------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int] | PageChain, full_pages: torch.Tensor | None = None,
               window_pages: torch.Tensor | None = None, window_first: int = 0,
               checkpoints: dict[int, torch.Tensor] | None = None) -> None:
        """Cache what one request computed.

        Args:
            token_ids: the sequence (or its PageChain).
            full_pages: ``[n, *full_shape]``, pages ``0..n-1``.
            window_pages: ``[m, *window_shape]``, pages ``window_first..window_first+m-1``
                (only those the request holds right: it never loaded older ones).
            checkpoints: ``{h: state [state_numel]}``, the state after ``h`` pages, ``h``
                a positive multiple of ``checkpoint_pages`` within the full pages.
        Raises InvalidParams on a checkpoint at another position or of another size.
        """
        chain = token_ids if isinstance(token_ids, PageChain) else page_chain(self.ns, token_ids)
        at = sorted(checkpoints or {}) if self.states is not None else []
        self._check_checkpoints(chain, at, checkpoints)
        hi = window_first + (window_pages.shape[0] if window_pages is not None else 0)
        if hi > len(chain.keys):
            raise InvalidParams(f"window pages up to {hi} for {len(chain.keys)} full pages")
        if self.full is not None and full_pages is not None:
            self.full.insert(chain, full_pages)
        if self.windows is not None and hi > window_first:
            self.windows.insert(chain.keys[window_first:hi], chain.tokens[window_first:hi],
                                range(window_first, hi), window_pages)
        if at:
            self.states.insert([chain.keys[h - 1] for h in at], [chain.tokens[h - 1] for h in at],
                               [h - 1 for h in at], torch.stack([checkpoints[h] for h in at]))

    def _check_checkpoints(self, chain: PageChain, at: list[int], checkpoints) -> None:
        for h in at:
            if h <= 0 or h % self.checkpoint_pages or h > len(chain.keys):
                raise InvalidParams(f"checkpoint after {h} pages: must be a positive multiple "
                                    f"of {self.checkpoint_pages} within {len(chain.keys)} pages")
            if tuple(checkpoints[h].shape) != self.states.shape:
                raise InvalidParams(f"checkpoint of shape {tuple(checkpoints[h].shape)}, "
                                    f"expected {self.states.shape}")

    def stored_bytes(self, num_tokens: int) -> dict[str, int]:
        """Payload bytes this cache stores for one sequence of ``num_tokens`` tokens, per
        part ("full", "window", "state"; the 128-byte header of each object aside): the
        full and window parts of its full pages, and its checkpoints."""
        pages = num_tokens // self.page_size
        out = {}
        if self.full is not None:
            out["full"] = pages * self.full.pool.page_bytes
        if self.windows is not None:
            out[WINDOW] = pages * self.windows.pool.page_bytes
        if self.states is not None:
            out[STATE] = pages // self.checkpoint_pages * self.states.pool.page_bytes
        return out

    def _tiers(self) -> list:
        """What has L3 backups and threads: the full pages' cache, each part's L3 tier."""
        parts = [p.l3_tier for p in (self.windows, self.states) if p is not None]
        return [t for t in [self.full, *parts] if t is not None]

    def reserve(self, pages: int) -> None:
        """:meth:`PrefixCache.reserve` of the full-attention pages (the bulk of a long
        prefix's bytes); the window and state parts read a few objects per match."""
        if self.full is not None:
            self.full.reserve(pages)

    def flush(self) -> None:
        """Wait until every queued L3 backup of every part is written."""
        for tier in self._tiers():
            tier.flush()

    def close(self) -> None:
        """Stop every part's threads (queued backups are written first)."""
        for tier in self._tiers():
            tier.close()

    def __enter__(self) -> HybridCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
