"""Helpers shared by the cache tests (a plain module: pytest puts tests/ on sys.path)."""


def lookup(cache, tokens):
    """(num_pages, tiers, pages) of a match + load on ``cache``, released afterwards."""
    m = cache.match(tokens)
    try:
        pages = cache.load(m)
        return m.num_pages, m.tiers, pages
    finally:
        cache.release(m)


class Stuck(Exception):
    """Raised into a worker thread that ran past its deadline, to stop it."""


def within(seconds, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run on a worker thread; its result (or its exception).

    Fails the test when ``fn`` has not returned after ``seconds`` (a deadline, far
    above the milliseconds a cache operation takes): a livelock then stops the test
    instead of hanging it. The stuck worker is stopped by raising :class:`Stuck` into it
    (CPython's PyThreadState_SetAsyncExc; a Python-level loop sees it at once), so it
    does not spin on, holding the cache's lock, while the other tests run.
    """
    import ctypes
    import threading

    done = {}

    def run():
        try:
            done["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller below
            done["error"] = exc

    worker = threading.Thread(target=run, name="deadline-worker", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident),
                                                   ctypes.py_object(Stuck))
        worker.join(seconds)
        raise AssertionError(f"{getattr(fn, '__name__', fn)} did not return within {seconds} s")
    if "error" in done:
        raise done["error"]
    return done["value"]
