"""Helpers shared by the cache tests (a plain module: pytest puts tests/ on sys.path)."""


def lookup(cache, tokens):
    """(num_pages, tiers, pages) of a match + load on ``cache``, released afterwards."""
    m = cache.match(tokens)
    try:
        pages = cache.load(m)
        return m.num_pages, m.tiers, pages
    finally:
        cache.release(m)
