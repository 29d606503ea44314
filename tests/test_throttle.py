"""Throttle: a recurring condition's log line, at once and then at most once per interval,
on an injected clock."""

from __future__ import annotations

import threading

from kvpool.throttle import Throttle


def test_first_is_due_then_one_line_per_interval_with_the_count_between():
    now = [100.0]
    say = Throttle(60.0, clock=lambda: now[0])
    assert say.due(0) == 0  # nothing to say: the first line is still due
    assert say.due() == 1
    assert [say.due() for _ in range(5)] == [0] * 5
    now[0] += 59.9
    assert say.due(3) == 0
    now[0] += 0.1
    assert say.due() == 9  # five, three and this one since the last line
    assert say.due() == 0 and say.total == 11


def test_counts_from_many_threads_are_all_said_or_kept():
    now = [0.0]
    say = Throttle(1.0, clock=lambda: now[0])
    said = []

    def note():
        for _ in range(1000):
            said.append(say.due())

    threads = [threading.Thread(target=note) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    now[0] += 1.0
    said.append(say.due(0))  # flush what was counted since the first line
    assert sum(said) == say.total == 4000
