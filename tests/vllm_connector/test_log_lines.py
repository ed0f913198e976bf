"""Log lines a stranger can cause are throttled (``connector.logs.Throttle``): a bounded number
per reason and window, each later one saying how many like it were held back."""

from __future__ import annotations

from connector.logs import Throttle, held_note


def test_at_most_burst_lines_per_key_and_window_then_the_held_count():
    throttle = Throttle(burst=3, interval_s=10.0)
    shown = [throttle.allow("timeout", now=t)[0] for t in (0.0, 1.0, 2.0, 3.0, 4.0)]
    assert shown == [True, True, True, False, False]
    assert throttle.allow("digest", now=4.5) == (True, 0)  # another reason: its own budget
    assert throttle.allow("timeout", now=10.5) == (True, 2)  # a new window: says what it held
    assert throttle.allow("timeout", now=11.0) == (True, 0)
    assert held_note(2) == " (2 more like it were not logged)" and held_note(0) == ""


def test_it_remembers_a_bounded_number_of_keys():
    throttle = Throttle(burst=1, interval_s=60.0, max_keys=4)
    for i in range(100):
        assert throttle.allow(f"peer-{i}", now=float(i))[0]
    assert len(throttle._keys) == 4
