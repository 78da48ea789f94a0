"""The overload guard: which requests reached extproc too late to be worth deciding."""

from __future__ import annotations

import pytest

from extproc.core.overload import OverloadGuard

T0 = 1_800_000_000.0


def stamp(at: float) -> bytes:
    return f"{at:.3f}".encode()


def late_for(guard: OverloadGuard, start: float, seconds: float, delay: float,
             step: float = 0.01) -> list[bool]:
    """Requests every ``step`` seen ``delay`` after their stamp, from ``start`` for ``seconds``."""
    answers, t = [], start
    while t < start + seconds:
        answers.append(guard.admit(stamp(t - delay), t))
        t += step
    return answers


def test_on_time_is_decided_and_a_standing_queue_of_late_ones_is_refused() -> None:
    guard = OverloadGuard(0.1)
    assert guard.persist == 0.2
    assert guard.admit(stamp(T0), T0 + 0.002)
    assert guard.admit(stamp(T0 + 1), T0 + 1 + 0.09)
    # Every request 0.3 s late for a second: the first 0.2 s of them are decided (it may be a burst),
    # then the rest are refused.
    answers = late_for(guard, T0 + 2, 1.0, 0.3)
    assert answers[:20] == [True] * 20
    assert not any(answers[22:])
    assert guard.take_refused() == len(answers) - answers.count(True)
    assert guard.take_refused() == 0
    # One on time ends the run of late ones.
    assert guard.admit(stamp(T0 + 4), T0 + 4.01)
    assert guard.admit(stamp(T0 + 4.1 - 0.3), T0 + 4.1)


def test_the_burst_a_pause_leaves_behind_is_decided() -> None:
    """A 1 s pause of the process: the requests that came meanwhile are all late, all at once, with
    nothing behind them; none is refused."""
    guard = OverloadGuard(0.1)
    for i in range(100):
        assert guard.admit(stamp(T0 + i * 0.01), T0 + i * 0.01 + 0.002)
    resumed = T0 + 2.0
    burst = [guard.admit(stamp(T0 + 1 + k * 0.01), resumed + k * 0.0005) for k in range(100)]
    assert all(burst)
    assert guard.admit(stamp(resumed + 0.06), resumed + 0.062)


@pytest.mark.parametrize("skew", [-30.0, -0.5, 0.0, 0.4, 25.0])
def test_the_proxys_clock_may_be_ahead_or_behind(skew: float) -> None:
    """Only the delay beyond the smallest one seen counts: the clocks' offset cancels out."""
    guard = OverloadGuard(0.1)
    for i in range(50):
        sent = T0 + i * 0.01
        assert guard.admit(stamp(sent + skew), sent + 0.003)
    sent = T0 + 1
    assert guard.admit(stamp(sent + skew), sent + 0.08)
    assert guard.delay(stamp(sent + skew), sent + 0.15) == pytest.approx(0.147, abs=0.002)
    answers = [guard.admit(stamp(sent + k * 0.01 + skew), sent + k * 0.01 + 0.15) for k in range(50)]
    assert answers[:20] == [True] * 20
    assert not any(answers[22:])


def test_no_stamp_a_garbled_one_or_the_guard_off_decide_the_request() -> None:
    guard = OverloadGuard(0.1)
    assert guard.admit(stamp(T0), T0)
    for garbage in (None, b"", b"soon", b"nan", b"inf", b"-inf", "1e400", b"\xff\xfe"):
        assert guard.admit(garbage, T0 + 50)
    off = OverloadGuard(0)
    assert off.admit(stamp(T0), T0)
    assert off.admit(stamp(T0), T0 + 3600)
    assert off.refused == 0


def test_a_sustained_overload_keeps_the_floor_it_learnt_while_calm() -> None:
    """While every request comes late, the floor is the one learnt before: the guard keeps refusing
    for the floor's whole span (a minute), then relaxes to what it sees."""
    guard = OverloadGuard(0.1)
    for i in range(100):
        assert guard.admit(stamp(T0 + i * 0.01), T0 + i * 0.01 + 0.002)
    span = OverloadGuard.WINDOW * OverloadGuard.WINDOWS
    answers = late_for(guard, T0 + 1, span - 2 * OverloadGuard.WINDOW, 0.5, step=0.05)
    assert answers.count(True) <= 5  # (the first 0.2 s of them)
    # Past the span, 0.5 s is the smallest delay it knows: the same requests are decided again.
    t = T0 + 1 + span + 2 * OverloadGuard.WINDOW
    assert guard.admit(stamp(t - 0.5), t)


def test_after_a_quiet_spell_the_floor_is_learnt_again() -> None:
    """A clock that stepped while no request came does not leave everything refused for a minute."""
    guard = OverloadGuard(0.1)
    assert guard.admit(stamp(T0), T0 + 0.001)
    later = T0 + 3600
    # The proxy's clock now runs 2 s behind this one.
    assert guard.admit(stamp(later - 2), later)
    assert guard.admit(stamp(later + 1 - 2), later + 1.01)
    answers = late_for(guard, later + 2, 1.0, 2.3)
    assert answers[0]
    assert not any(answers[22:])


def test_a_clock_that_steps_under_load_is_followed_within_the_span() -> None:
    guard = OverloadGuard(0.1)
    t = T0
    while t < T0 + 10:
        assert guard.admit(stamp(t), t + 0.002)
        t += 0.01
    # The proxy's clock steps 1 s back: every request looks 1 s late, for at most the span.
    span = OverloadGuard.WINDOW * (OverloadGuard.WINDOWS + 1)
    first_admitted = None
    while t < T0 + 10 + 2 * span:
        if guard.admit(stamp(t - 1), t + 0.002) and first_admitted is None:
            first_admitted = t
        t += 0.01
    assert first_admitted is not None
    assert first_admitted - (T0 + 10) <= span + 0.05


def test_an_overload_that_lets_one_through_on_time_now_and_then_stays_refused() -> None:
    """After a refusal, late requests are refused at once for RECALL seconds: an on-time one between
    them does not buy the next late ones another wait."""
    guard = OverloadGuard(0.1)
    assert guard.admit(stamp(T0), T0 + 0.001)
    answers = late_for(guard, T0 + 1, 0.5, 0.3)
    assert not answers[-1]
    t = T0 + 1.5
    assert guard.admit(stamp(t), t + 0.01)  # on time
    assert not guard.admit(stamp(t + 0.1 - 0.3), t + 0.1)  # late again at once: refused
    # Long after the last refusal, a late burst gets the wait again.
    t = T0 + 1.6 + OverloadGuard.RECALL + 1
    assert guard.admit(stamp(t), t + 0.01)
    assert guard.admit(stamp(t + 0.1 - 0.3), t + 0.1)
