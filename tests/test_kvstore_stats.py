"""Store statistics: counters, one tier's stats row, the hit-rate line and the thread that logs it."""

from __future__ import annotations

import logging
import time

import pytest

from ragcache.kvstore import TierUsage
from ragcache.kvstore.stats import HitRateLog, TierCounters, hit_rate_line, stats_row


def test_counters_add_by_name_and_reject_unknown_names():
    c = TierCounters()
    c.add(hits=3, misses=1)
    c.add(misses=1, foreign=1, bytes_read=0)
    assert (c.hits, c.misses, c.foreign, c.lookups) == (3, 2, 1, 5)
    assert c.hit_rate == pytest.approx(0.6)
    with pytest.raises(AttributeError):
        c.add(hitz=1)
    assert TierCounters().hit_rate == 0.0


def test_stats_row_holds_counters_usage_capacity_and_state():
    row = stats_row(TierCounters(hits=1, misses=3, evictions=2), TierUsage(4, 1000), None, False)
    assert row == {
        "hits": 1, "misses": 3, "hit_rate": 0.25, "bytes_read": 0, "bytes_written": 0,
        "evictions": 2, "corrupt": 0, "foreign": 0, "write_errors": 0,
        "entries": 4, "occupancy_bytes": 1000, "capacity_bytes": None, "up": False,
    }


def test_hit_rate_line_shows_every_tier_top_down_and_marks_down_ones():
    line = hit_rate_line([("cpu", TierCounters(hits=3, misses=1), True),
                          ("disk", TierCounters(hits=1), True),
                          ("remote", TierCounters(), False)])
    assert line == "cpu 75.0% (3/4) | disk 100.0% (1/1) | remote - (0/0) DOWN"
    assert hit_rate_line([]) == ""


def test_hit_rate_log_writes_lines_until_stopped_and_survives_a_failing_line(caplog):
    calls = []

    def line() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("formatting problem")
        return f"cpu call {len(calls)}"

    with caplog.at_level(logging.INFO, logger="ragcache.kvstore"):
        log = HitRateLog(line, 0.01)
        deadline = time.monotonic() + 5
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        log.stop()
        stopped_at = len(calls)
        time.sleep(0.05)
    assert len(calls) == stopped_at >= 3
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert lines[:2] == ["kv hit rates: cpu call 2", "kv hit rates: cpu call 3"]
