"""TierGuard: marking a tier down and up, the doubling back-off, one prober per retry, rate-limited warnings."""

from __future__ import annotations

import logging

import pytest

from ragcache.kvstore import TierError, TierUnavailableError
from ragcache.kvstore.guard import WARN_EVERY_SEC, TierDown, TierGuard


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def unreachable() -> None:
    raise TierUnavailableError("connection refused")


def test_unreachable_tier_is_marked_down_once_and_skipped_until_the_retry_is_due(caplog):
    clock = Clock()
    guard = TierGuard("remote", backoff_sec=2.0, backoff_max_sec=10.0, clock=clock)
    assert guard.available() and guard.call(lambda x: x + 1, 1) == 2
    with caplog.at_level(logging.WARNING, logger="ragcache.kvstore"):
        with pytest.raises(TierDown):
            guard.call(unreachable)
    assert guard.up is False and guard.retry_at == 102.0
    assert [r.getMessage() for r in caplog.records] == [
        "remote tier unavailable (connection refused); continuing with the other tiers, retrying every 2-10 s"]
    clock.now = 101.9
    assert guard.available() is False
    clock.now = 102.0
    assert guard.available() is True  # this caller probes...
    assert guard.available() is False  # ...the others keep skipping meanwhile


def test_back_off_doubles_up_to_the_maximum_and_resets_when_the_tier_answers(caplog):
    clock = Clock()
    guard = TierGuard("remote", backoff_sec=2.0, backoff_max_sec=10.0, clock=clock)
    waits = []
    with caplog.at_level(logging.WARNING, logger="ragcache.kvstore"):
        for _ in range(5):
            with pytest.raises(TierDown):
                guard.call(unreachable)
            waits.append(guard.retry_at - clock.now)
        assert waits == [2.0, 4.0, 8.0, 10.0, 10.0]
        clock.now = guard.retry_at
        assert guard.available() and guard.call(lambda: "pong") == "pong"
    assert guard.up is True and guard.backoff == 2.0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and messages[-1] == "remote tier reachable again"  # one per outage, one on return
    with pytest.raises(TierDown):
        guard.call(unreachable)
    assert guard.retry_at - clock.now == 2.0  # a new outage starts from the first wait again


@pytest.mark.parametrize("error", [TierError("OOM command not allowed"), OSError(28, "No space left")])
def test_other_failures_pass_through_and_leave_the_tier_up(error):
    guard = TierGuard("disk", clock=Clock())

    def fail() -> None:
        raise error

    with pytest.raises(type(error)):
        guard.call(fail)
    assert guard.up is True and guard.available()


def test_warnings_of_one_kind_are_logged_at_most_once_a_minute(caplog):
    clock = Clock()
    guard = TierGuard("disk", clock=clock)
    with caplog.at_level(logging.WARNING, logger="ragcache.kvstore"):
        guard.warn("write", "write 1")
        guard.warn("write", "write 2")
        guard.warn("read", "read 1")
        clock.now += WARN_EVERY_SEC - 0.1
        guard.warn("write", "write 3")
        clock.now += 0.1
        guard.warn("write", "write 4")
    assert [r.getMessage() for r in caplog.records] == ["write 1", "read 1", "write 4"]
