"""Store statistics: counters, one tier's stats row, the hit-rate line and the thread that logs it."""

from __future__ import annotations

import logging
import time

import pytest

from ragcache.kvstore import TierUsage
from ragcache.kvstore.stats import HitRateLog, LookupCounters, TierCounters, hit_rate_line, stats_row


def test_counters_add_by_name_and_reject_unknown_names():
    c = TierCounters()
    c.add(hits=3, corrupt=1)
    c.add(unavailable=1, foreign=1, bytes_read=0)
    assert (c.hits, c.corrupt, c.unavailable, c.foreign) == (3, 1, 1, 1)
    assert c.minus(TierCounters(hits=1))["hits"] == 2
    with pytest.raises(AttributeError):
        c.add(hitz=1)
    with pytest.raises(AttributeError):
        c.add(misses=1)  # a tier's misses are derived from the store's lookups, never counted apart


def test_stats_row_derives_misses_and_hit_rate_from_the_stores_lookups():
    row = stats_row(TierCounters(hits=1, evictions=2, not_stored=3), 4, TierUsage(4, 1000), None, False,
                    free_bytes=None)
    assert row["hits"] + row["misses"] == row["lookups"] == 4
    assert row["hit_rate"] == 0.25 and row["not_stored"] == 3 and row["evictions"] == 2
    assert (row["entries"], row["occupancy_bytes"], row["capacity_bytes"], row["up"]) == (4, 1000, None, False)
    assert row["free_bytes"] is None
    assert stats_row(TierCounters(), 0, TierUsage(0, 0), 10, True)["hit_rate"] == 0.0


def test_hit_rate_line_shares_of_lookups_add_up_to_100_percent_with_the_misses():
    line = hit_rate_line(LookupCounters(lookups=8, head_lookups=2, head_hits=1),
                         [("cpu", TierCounters(hits=4), True),
                          ("disk", TierCounters(hits=2), True),
                          ("remote", TierCounters(), False)])
    assert line == ("8 lookups: cpu 50.0% (4) | disk 25.0% (2) | remote 0.0% (0) DOWN | miss 25.0% (2); "
                    "head 1/2")
    assert hit_rate_line(LookupCounters(), []) == "0 lookups: miss - (0); head 0/0"


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


def test_the_drivers_tier_stats_has_a_field_for_every_key_of_a_stats_row():
    """``TierStats`` (engine/messages.py, torch-free) takes its counter fields from ``TierCounters``
    and declares the row's other keys itself; this keeps those from drifting from ``stats_row``
    (``TierStats.from_dict`` drops unknown keys silently)."""
    from dataclasses import fields

    from ragcache.engine.messages import TierStats

    row = stats_row(TierCounters(), 0, TierUsage(0, 0), None, True, configured_capacity_bytes=None, free_bytes=None)
    assert set(row) == {f.name for f in fields(TierStats)}
