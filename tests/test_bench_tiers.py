"""ragcache.bench.tiers without an engine: the summary against the cpu tier and the disk targets."""

from __future__ import annotations

import pytest

from ragcache.bench.report import render
from ragcache.bench.tiers import _tiers_summary


def _row(tier, overlap, ttft, example=0, repeat=0, served=("cpu",)):
    return {"tier": tier, "pipeline_overlap": overlap, "example": example, "repeat": repeat, "ttft_s": ttft,
            "load_s": ttft / 2, "worker_s": ttft / 2, "ctx_tokens": 100, "served_by": list(served),
            "full_ttft_s": 10.0 if tier == "cpu" else None}


def test_tiers_summary_takes_medians_of_per_request_ratios_to_the_cpu_tier():
    rows = [_row("cpu", True, 1.0), _row("cpu", True, 2.0, repeat=1), _row("cpu", False, 1.0),
            _row("disk", True, 1.1, served=("disk",)), _row("disk", True, 2.6, repeat=1, served=("disk",)),
            _row("disk-cold", True, 3.0, served=("disk",)), _row("disk", False, 4.0, served=("disk",))]
    out = _tiers_summary(rows)
    by = {(s["tier"], s["pipeline_overlap"]): s for s in out["summary"]}
    assert list(by) == [("cpu", True), ("cpu", False), ("disk", True), ("disk", False), ("disk-cold", True)]
    assert by["disk", True]["vs_cpu_median"] == pytest.approx(1.2)  # median of 1.1/1.0 and 2.6/2.0
    assert by["disk", True]["n"] == 2 and by["disk", True]["served_by"] == ["disk"]
    assert by["disk", False]["vs_cpu_median"] == 4.0 and by["disk-cold", True]["vs_cpu_median"] == 3.0
    assert out["targets"]["disk_vs_cpu"]["met"] is True and out["targets"]["disk_vs_cpu"]["max"] == 1.2
    assert out["targets"]["disk_cold_vs_cpu"]["met"] is False
    result = {"benchmark": "tiers", "n": 1, "full_ttft_median_s": 10.0, **out}
    text = render(result)
    assert "blend TTFT by tier" in text and "disk_cold_vs_cpu" in text


def test_tiers_summary_without_disk_rows_has_no_targets():
    out = _tiers_summary([_row("cpu", True, 1.0), _row("remote", True, 2.0, served=("remote",))])
    assert out["targets"] == {} and [s["vs_cpu_median"] for s in out["summary"]] == [1.0, 2.0]
