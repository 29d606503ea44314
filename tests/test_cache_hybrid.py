"""HybridCache: full pages, window pages and state checkpoints of hybrid models.

Tensors stand in for the engine (its end-to-end runs are in test_engine_hybrid.py); L3 is
a real DiskBackend directory, so every part goes through its objects, headers and checks.
"""

import pytest
import torch

from kvpool.cache import DiskBackend, Namespace
from kvpool.cache.hybrid import HybridCache, window_first_page
from kvpool.cache.keys import page_chain, page_keys, store_key
from kvpool.errors import InvalidParams

P = 4                        # tokens per page
FULL = (1, 2, 2, P, 3)       # one full-attention layer
WINDOW = (2, 2, 2, P, 3)     # two sliding layers
STATE = 10                   # elements of one checkpoint
C = 2                        # pages between checkpoints
NS = Namespace(model="tiny-hybrid", page_size=P, extra=("layers=SLSF",))


def pages(n, shape, seed):
    return torch.randn((n, *shape), generator=torch.Generator().manual_seed(seed))


def state(h):
    """A checkpoint that says where it was taken."""
    return torch.full((STATE,), float(h))


def tokens(n_pages, base=100):
    return list(range(base, base + n_pages * P))


@pytest.fixture
def make(tmp_path):
    made = []

    def build(l3=None, **kw):
        kw.setdefault("full_shape", FULL)
        kw.setdefault("state_numel", STATE)
        cache = HybridCache(NS, checkpoint_pages=C, l3=l3, async_backup=False, **kw)
        made.append(cache)
        return cache

    yield build
    for cache in made:
        cache.close()


def fill(cache, toks, n, window_first=0, with_states=True, seed=0):
    """Insert n pages (and checkpoints at every C pages); returns (full, window) pages."""
    full = pages(n, FULL, seed) if cache.full is not None else None
    win = pages(n - window_first, WINDOW, seed + 1) if cache.windows is not None else None
    ckpts = {h: state(h) for h in range(C, n + 1, C)} if with_states else {}
    cache.insert(toks[:n * P], full, win, window_first, ckpts)
    return full, win


def test_a_hit_ends_at_the_last_checkpoint_and_counts_the_tokens_lost(make):
    cache = make()
    toks = tokens(8)
    full, _ = fill(cache, toks, 7)            # checkpoints after 2, 4, 6 pages
    m = cache.match(toks, max_pages=7)        # all 7 full pages are cached
    got = cache.load(m)
    assert m.num_pages == 6 and m.lost_tokens == P   # page 7 lies after the last checkpoint
    assert torch.equal(got.full, full[:6]) and torch.equal(got.state, state(6))
    cache.release(m)
    assert cache.metrics["checkpoint_lost_tokens"] == P
    assert cache.metrics["checkpoint_hits"] == 1


def test_a_prefix_that_diverges_between_checkpoints_falls_back_to_the_previous_one(make):
    cache = make()
    fill(cache, tokens(8), 8)
    other = tokens(8)[:5 * P] + [9] * (3 * P)  # shares 5 pages, checkpoints at 2 and 4
    m = cache.match(other)
    assert (m.num_pages, m.lost_tokens) == (4, P)
    assert torch.equal(cache.load(m).state, state(4))
    cache.release(m)


def test_without_a_checkpoint_there_is_no_hit_whatever_kv_is_cached(make):
    cache = make()
    fill(cache, tokens(4), 4, with_states=False)
    m = cache.match(tokens(4))
    assert m.num_pages == 0 and m.lost_tokens == 4 * P
    assert cache.load(m).full is None
    cache.release(m)


def test_checkpoints_must_sit_on_the_spacing(make):
    cache = make()
    with pytest.raises(InvalidParams, match="multiple of 2"):
        cache.insert(tokens(4), pages(4, FULL, 0), checkpoints={3: state(3)})
    with pytest.raises(InvalidParams, match="shape"):
        cache.insert(tokens(4), pages(4, FULL, 0), checkpoints={2: torch.zeros(3)})


def test_a_loaded_checkpoint_is_the_callers_copy(make):
    cache = make()
    fill(cache, tokens(4), 4)
    m = cache.match(tokens(4) + [1])
    got = cache.load(m)
    got.state.add_(100.0)                     # the request goes on from its own copy
    cache.release(m)
    m = cache.match(tokens(4) + [1])
    assert torch.equal(cache.load(m).state, state(4))
    cache.release(m)


@pytest.mark.parametrize("window", [1, 4, 5, 9, 100])
def test_window_first_page_covers_exactly_the_window(window):
    for hit in range(1, 6):
        first = window_first_page(hit, window, P)
        need = max(0, hit * P - (window - 1))  # the oldest token the next query sees
        assert first * P <= need and (first == 0 or first * P + P > need)


def test_sliding_layers_load_only_the_window_and_older_pages_may_be_gone(make):
    cache = make(window_shape=WINDOW, window=6, state_numel=0)
    toks = tokens(6)
    full, win = fill(cache, toks, 6, with_states=False)
    m = cache.match(toks + [1])
    first = window_first_page(6, 6, P)
    assert m.num_pages == 6 and m.window_first == first == 4
    got = cache.load(m)
    assert torch.equal(got.full, full) and torch.equal(got.window, win[first:])
    cache.release(m)
    assert cache.metrics["window_pages_skipped"] == first

    # a later request's pages from the window's start only: the old ones never existed
    again = make(window_shape=WINDOW, window=6, state_numel=0)
    again.insert(toks, full, win[first:], first)
    m = again.match(toks + [1])
    assert m.num_pages == 6
    assert torch.equal(again.load(m).window, win[first:])
    again.release(m)
    m = again.match(toks[:5 * P] + [1])       # ending earlier needs page 2, never stored
    assert m.num_pages == 0
    again.release(m)


def test_old_window_pages_are_evicted_first(make):
    cache = make(window_shape=WINDOW, window=6, state_numel=0, l1_window_pages=6)
    toks = tokens(6)
    fill(cache, toks, 6, with_states=False)
    m = cache.match(toks + [1])               # touches only the window pages 4 and 5
    cache.release(m)
    b = tokens(2, base=5000)
    fill(cache, b, 2, with_states=False, seed=7)
    assert cache.metrics["window_evictions_l1"] == 2
    m = cache.match(toks + [1])               # the window is still there: still a hit
    assert m.num_pages == 6
    cache.release(m)
    m = cache.match(toks[:2 * P] + [1])       # the oldest pages went first
    assert m.num_pages == 0
    cache.release(m)


def test_every_part_comes_back_from_l3_checked(make, tmp_path):
    disk = DiskBackend(tmp_path / "l3", 1 << 24)
    writer = make(l3=disk, window_shape=WINDOW, window=6)
    toks = tokens(6)
    full, win = fill(writer, toks, 6)
    writer.flush()
    reader = make(l3=disk, window_shape=WINDOW, window=6)
    m = reader.match(toks + [1])
    assert m.num_pages == 6 and m.tokens_by_tier() == {"L3": 6 * P}
    got = reader.load(m)
    assert torch.equal(got.full, full) and torch.equal(got.window, win[4:])
    assert torch.equal(got.state, state(6))
    reader.release(m)
    snap = reader.metrics.snapshot()
    assert snap["state_pages_loaded_l3"] == 1 and snap["window_pages_loaded_l3"] == 2


def test_a_checkpoint_under_another_key_is_refused_and_the_hit_falls_back(make, tmp_path):
    disk = DiskBackend(tmp_path / "l3", 1 << 24)
    writer = make(l3=disk)
    toks = tokens(4)
    fill(writer, toks, 4)
    writer.flush()
    keys = page_keys(NS, toks)
    two, four = (store_key(keys[h - 1], "state") for h in (2, 4))
    disk._file(four).unlink()
    disk.put([four], disk.get([two]))          # the checkpoint after 2 pages, under 4's key
    reader = make(l3=disk)
    m = reader.match(toks + [1])
    assert m.num_pages == 4                   # every object is present ...
    got = reader.load(m)
    assert m.num_pages == 0 and got.state is None   # ... but its header names another page
    reader.release(m)
    assert reader.metrics["state_page_rejects_page_key"] == 1
    assert reader.metrics["hybrid_fallbacks"] == 1


def test_k17_a_hit_needs_every_object_it_will_read(make, tmp_path):
    disk = DiskBackend(tmp_path / "l3", 1 << 24)
    writer = make(l3=disk, window_shape=WINDOW, window=6)
    toks = tokens(6)
    fill(writer, toks, 6)
    writer.flush()
    keys = page_keys(NS, toks)
    for key, part in ((keys[5], "state"), (keys[3], "window")):  # as evictions would
        disk._file(store_key(key, part)).unlink()
    reader = make(l3=disk, window_shape=WINDOW, window=6)
    m = reader.match(toks + [1])
    # checkpoint 6 gone; checkpoint 4 needs window pages 2, 3: page 3's window object is gone
    assert m.num_pages == 2 and m.lost_tokens == 4 * P
    reader.release(m)


def test_another_namespace_never_hits(make):
    cache = make()
    fill(cache, tokens(4), 4)
    other = HybridCache(Namespace(model="tiny-hybrid", page_size=P, extra=("layers=LLLF",)),
                        FULL, state_numel=STATE, checkpoint_pages=C)
    try:
        with pytest.raises(InvalidParams, match="another namespace"):
            other.match(page_chain(NS, tokens(4)))
    finally:
        other.close()
