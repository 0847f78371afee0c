"""ragcache.bench.report without a model: tables, targets, plots and result files, and the tables of
docs/benchmarks.md, generated from the committed JSON under docs/bench/ (drift between a figure and
its run fails here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ragcache.bench.report import (SECTION, markdown_table, overridden_settings, regenerate, render, section,
                                   stale_sections, summary_table, write_result)
from ragcache.bench.ttft import ttft_targets


def _summary(name, mode, ratio, ttft, speedup, kl, nll, rel):
    return {"variant": name, "mode": mode, "recompute_ratio": ratio, "n": 2, "ttft_median_s": ttft, "ttft_p90_s": ttft,
            "ttft_mean_s": ttft, "speedup_median": speedup, "load_s_median": 0.0, "worker_s_median": 0.0,
            "kl_mean": kl, "kl_median": kl, "gold_nll_mean": nll, "gold_nll_rel_full": rel, "f1_mean": 0.1,
            "rouge_l_mean": 0.1, "em_mean": 0.0, "agree_em_mean": 1.0, "agree_rouge_l_mean": 1.0,
            "agree_tokens_mean": 1.0, "recomputed_frac_mean": 0.15, "prompt_tokens_mean": 100.0}


def test_ttft_targets_tables_and_plot(tmp_path):
    modes = {"full": _summary("full", "full", None, 10.0, 1.0, 0.0, 2.0, 0.0),
             "reuse": _summary("reuse", "reuse", None, 1.0, 10.0, 0.4, 2.2, 0.1),
             "blend": _summary("blend@0.15", "blend", 0.15, 2.0, 5.0, 0.1, 2.02, 0.01)}
    result = {"benchmark": "ttft", "n": 2, "passages": 3, "modes": modes,
              "sweep": [_summary("blend@0.05", "blend", 0.05, 1.5, 6.6, 0.3, 2.1, 0.05), modes["blend"]],
              "targets": ttft_targets(modes), "machine": {"cpu_count": 2}}
    t = result["targets"]
    assert t["blend_ttft_speedup"]["met"] and t["blend_gold_nll_vs_full"]["met"] is True
    assert "blend_kl_vs_reuse" not in t  # short prompts (100 tokens): judged by their answers, not the first token
    modes["blend"]["prompt_tokens_mean"] = 6000.0
    assert ttft_targets(modes)["blend_kl_vs_reuse"]["value"] == pytest.approx(0.25)
    text = render(result)
    assert "blend@0.15" in text and "recompute-ratio sweep" in text and "targets" in text
    paths = write_result(result, tmp_path / "r.json")
    assert json.loads(paths["json"].read_text())["plot"] == "r.png"
    assert paths["png"].stat().st_size > 1000 and "| mode |" in paths["md"].read_text()


def test_markdown_table_escapes_pipes_inside_cells():
    md = markdown_table(["target", "limit"], [["KL(full||blend)", "|x| ≤ 0.02"]])
    rows = md.splitlines()
    assert rows[2] == "| KL(full\\|\\|blend) | \\|x\\| ≤ 0.02 |"
    assert all(row.replace("\\|", "").count("|") == 3 for row in rows)


def test_full_vs_plain_is_the_median_of_per_example_ratios_not_a_ratio_of_medians():
    # plain's "speedup" is the median over examples of TTFT(full) / TTFT(plain): paired, as every ratio here
    modes = {"full": _summary("full", "full", None, 10.0, 1.0, 0.0, 2.0, 0.0),
             "plain": _summary("plain", "plain", None, 9.0, 1.02, None, None, None),
             "blend": _summary("blend@0.15", "blend", 0.15, 2.0, 5.0, 0.1, 2.02, 0.01)}
    modes["blend"]["speedup_vs_best_median"] = 4.5
    t = ttft_targets(modes)
    assert t["full_vs_plain"]["value"] == pytest.approx(1.02) and t["full_vs_plain"]["met"] is True
    assert t["blend_ttft_speedup_vs_best"]["value"] == pytest.approx(4.5)


def test_the_stage_table_has_a_ratio_one_column_only_when_the_run_had_ratio_one():
    from ragcache.bench.report import tables

    stages = {"variant": "blend:question@0.15", "stages_s": {"question_probe_s": 0.2}, "stages_s_reuse": {},
              "stages_s_ratio_one": {}, "worker_s": 1.0, "worker_s_ratio_one": None, "worker_s_reuse": 0.1,
              "ttft_s_plain": 4.0, "ttft_s_ratio_one": None, "floor_s": 0.8, "check_layer": 0, "num_layers": 30,
              "worker_vs_floor": 1.25}
    modes = {"blend": _summary("blend@0.15", "blend", 0.15, 2.0, 5.0, 0.1, 2.02, 0.01)}
    result = {"benchmark": "ttft", "n": 2, "passages": 3, "modes": modes, "sweep": [modes["blend"]]}
    title, header, rows = tables({**result, "stages": stages})[-1]
    assert header == ["stage", "blend:question@0.15", "reuse"] and "add 1 to --ratios" in title
    assert all(len(r) == 3 for r in rows) and ["worker / floor", 1.25, None] in rows

    one = {**stages, "stages_s_ratio_one": {"question_probe_s": 0.3}, "worker_s_ratio_one": 4.4,
           "ttft_s_ratio_one": 4.6}
    title, header, rows = tables({**result, "stages": one})[-1]
    assert header == ["stage", "blend:question@0.15", "ratio 1", "reuse"] and "vs ratio 1 vs reuse" in title
    assert ["question_probe_s", 0.2, 0.3, None] in rows and ["worker total", 1.0, 4.4, 0.1] in rows


def test_targets_depend_on_the_prompt_length_class():
    from ragcache.bench.common import TARGETS, prompt_length

    def modes(prompt_tokens, blend_rel=0.0, blend_loops=0.0, full_loops=0.0, agree_em=1.0, f1=0.1):
        m = {"full": _summary("full", "full", None, 10.0, 1.0, 0.0, 2.0, 0.0),
             "reuse": _summary("reuse", "reuse", None, 1.0, 10.0, 0.4, 2.2, 0.1),
             "blend": _summary("blend@0.15", "blend", 0.15, 3.0, 3.0, 0.05, 2.0 * (1 + blend_rel), blend_rel)}
        m["blend"]["prompt_tokens_mean"] = prompt_tokens
        m["blend"]["loop_share"], m["full"]["loop_share"] = blend_loops, full_loops
        m["blend"]["agree_em_mean"], m["blend"]["f1_mean"], m["blend"]["f1_full_mean"] = agree_em, f1, 0.1
        return m

    assert [prompt_length(t) for t in (1500.0, 3500.0, 6100.0, None)] == ["short", "mid", "long", "long"]
    # a 3x blend meets the short prompts' 2.2x and the mid ones' 3x, not the long ones' 4x
    short, mid, long_ = (ttft_targets(modes(t)) for t in (1500.0, 3500.0, 6100.0))
    assert short["blend_ttft_speedup"]["min"] == TARGETS["blend_ttft_speedup_min"]["short"] == 2.2
    assert short["blend_ttft_speedup"]["met"] is True and mid["blend_ttft_speedup"]["met"] is True
    assert "short prompts (mean 1500 tokens)" in short["blend_ttft_speedup"]["note"]
    assert long_["blend_ttft_speedup"]["min"] == 4.0 and long_["blend_ttft_speedup"]["met"] is False
    # short: answers (equal to full's, gold F1 against full's), no first-token KL; mid: both; long: KL
    assert set(short) - set(long_) == {"blend_agree_em", "blend_f1_vs_full"}
    assert "blend_kl_vs_reuse" not in short and "blend_agree_em" not in long_
    assert mid["blend_agree_em"]["min"] == 0.8 and short["blend_agree_em"]["min"] == 0.5
    assert "blend_kl_vs_reuse" in mid
    assert ttft_targets(modes(1500.0, agree_em=0.4))["blend_agree_em"]["met"] is False
    assert ttft_targets(modes(1500.0, f1=0.08))["blend_f1_vs_full"]["met"] is False  # 0.8 of full's F1
    assert ttft_targets(modes(1500.0, f1=0.095))["blend_f1_vs_full"]["met"] is True
    # KL 0.05 / 0.4 = 0.125 of reuse's: within 0.15
    assert long_["blend_kl_vs_reuse"]["met"] is True and long_["blend_kl_vs_reuse"]["max"] == 0.15
    # gold NLL: below full's is fine however far; above, at most 5%
    assert ttft_targets(modes(1500.0, -0.08))["blend_gold_nll_vs_full"]["met"] is True
    assert ttft_targets(modes(1500.0, 0.04))["blend_gold_nll_vs_full"]["met"] is True
    assert ttft_targets(modes(1500.0, 0.06))["blend_gold_nll_vs_full"]["met"] is False
    # loops: no more often than full prefill on the same prompts
    assert ttft_targets(modes(1500.0, blend_loops=0.1, full_loops=0.2))["blend_loops"]["met"] is True
    loops = ttft_targets(modes(1500.0, blend_loops=0.2, full_loops=0.1))["blend_loops"]
    assert loops["met"] is False and loops["max"] == 0.1
    # the probe's share and the compute floor are reported in the stage table, not judged
    assert not {"question_probe_share", "blend_worker_vs_floor"} & set(
        ttft_targets(modes(1500.0), {"stages_s": {"question_probe_s": 0.2}, "worker_vs_floor": 1.5}))
    # the operators one blend dispatched: judged against a constant, whatever the prompt's length
    assert "blend_aten_ops" not in short
    ops = {"total_median": 4200, "per_layer_median": 140.0, "aten_median": 3900, "n": 3}
    counted = ttft_targets(modes(6100.0), None, ops)["blend_aten_ops"]
    assert counted["value"] == 4200 and counted["max"] == TARGETS["blend_ops_max"] and counted["met"] is False
    assert "140 per layer" in counted["note"]
    assert ttft_targets(modes(1500.0), None, {**ops, "total_median": 900})["blend_aten_ops"]["met"] is True
    assert "ragcache's code" not in counted["note"]  # a run without the split says nothing of it
    split = ttft_targets(modes(6100.0), None, {**ops, "own_median": 2100})["blend_aten_ops"]["note"]
    assert "2100 called by ragcache's code" in split


def test_agreed_prefix_counts_tokens_until_the_first_divergence():
    from ragcache.bench.metrics import agreed_prefix

    assert agreed_prefix([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert agreed_prefix([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert agreed_prefix([9, 2, 3, 4], [1, 2, 3, 4]) == 0.0
    assert agreed_prefix([1, 2], [1, 2, 3, 4]) == 0.5  # stopped early: the rest is not agreed
    assert agreed_prefix([1, 2], []) is None


ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BENCHMARKS = DOCS / "benchmarks.md"


#: the documents with generated sections
GENERATED_DOCS = [BENCHMARKS, DOCS / "fidelity.md"]


@pytest.mark.parametrize("doc", GENERATED_DOCS, ids=lambda p: p.name)
def test_benchmarks_md_is_what_its_json_renders(doc):
    text = doc.read_text(encoding="utf-8")
    assert SECTION.search(text), f"{doc.name} has no generated section"
    assert stale_sections(text, DOCS) == [], f"run `ragcache bench report docs/{doc.name}`"
    assert regenerate(text, DOCS) == text
    outside = SECTION.sub("", text)
    assert not [line for line in outside.splitlines() if line.startswith("|")], "a table outside a generated section"


def test_every_table_of_benchmarks_md_is_generated_from_a_named_json_file():
    text = BENCHMARKS.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 400
    sections = list(SECTION.finditer(text))
    assert sections
    outside = SECTION.sub("", text)
    assert not [line for line in outside.splitlines() if line.startswith("|")], "a table outside a generated section"
    for m in sections:
        named = [w for w in m["spec"].split() if w.endswith(".json")]
        assert named and all((DOCS / w).is_file() for w in named), m["spec"]
        assert all(f"]({w})" in m["body"] for w in named), f"the section does not link its JSON: {m['spec']}"


@pytest.mark.parametrize("path", sorted((DOCS / "bench").glob("*.json")), ids=lambda p: p.name)
def test_every_committed_result_renders(path):
    result = json.loads(path.read_text(encoding="utf-8"))
    assert render(result, markdown=True).count("|---") >= 1


def test_a_changed_figure_shows_as_a_stale_section(tmp_path):
    (tmp_path / "bench").mkdir()
    result = json.loads((DOCS / "bench" / "bench_ingest.json").read_text(encoding="utf-8"))
    (tmp_path / "bench" / "r.json").write_text(json.dumps(result), encoding="utf-8")
    doc = tmp_path / "doc.md"
    doc.write_text("# t\n\n<!-- bench report: bench/r.json -->\n<!-- end bench report -->\n\nend\n", encoding="utf-8")
    fresh = regenerate(doc.read_text(encoding="utf-8"), tmp_path)
    assert "ingest (" in fresh and fresh.endswith("\n\nend\n") and stale_sections(fresh, tmp_path) == []
    result["precompute"]["tokens_per_s"] = 1.5
    (tmp_path / "bench" / "r.json").write_text(json.dumps(result), encoding="utf-8")
    assert stale_sections(fresh, tmp_path) == ["bench/r.json"]
    with pytest.raises(ValueError, match="tables 1-1"):
        section("bench/r.json tables=2", tmp_path)


def test_a_summary_row_names_the_settings_its_run_overrode():
    def run(command):
        modes = {"full": _summary("full", "full", None, 10.0, 1.0, 0.0, 2.0, 0.0),
                 "blend": _summary("blend@0.15", "blend", 0.15, 2.0, 5.0, 0.1, 2.02, 0.01)}
        for m in modes.values():
            m.update(agree_rouge_l_mean=1.0, recomputed_frac_mean=0.2)
        return {"benchmark": "ttft", "command": command, "n": 2, "modes": modes}

    tuned = run("RAGCACHE_BLEND__PROPAGATE=0.5 RAGCACHE_STORE__REMOTE_URL='redis://:***@h:6379' "
                "ragcache bench ttft --dataset musique --out x.json")
    assert overridden_settings(tuned) == "blend.propagate=0.5 store.remote_url=redis://:***@h:6379"
    assert overridden_settings(run("ragcache bench ttft RAGCACHE_BLEND__PROPAGATE=0.5")) is None  # an argument
    assert overridden_settings(run("RAGCACHE_BLEND__X='unbalanced ragcache")) is None
    title, h, rows = summary_table([("bench/a.json", tuned), ("bench/b.json", run("ragcache bench ttft"))])
    col = h.index("settings")
    assert [r[col] for r in rows] == ["blend.propagate=0.5 store.remote_url=redis://:***@h:6379", None]
    assert "'settings' the run's overrides" in title
    title, _, _ = summary_table([("bench/b.json", run("ragcache bench ttft"))])
    assert "engine record" in title and "'settings'" not in title


def test_bench_report_command_checks_and_rewrites_a_document(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "r.json").write_bytes((DOCS / "bench" / "bench_ingest.json").read_bytes())
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- bench report: bench/r.json -->\n<!-- end bench report -->\n", encoding="utf-8")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "app.cli", "bench", "report", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    assert cli(str(doc), "--check").returncode == 1
    assert cli(str(doc)).returncode == 0 and "ingest (" in doc.read_text(encoding="utf-8")
    assert cli(str(doc), "--check").returncode == 0
    missing = cli(str(tmp_path / "absent.json"))
    assert missing.returncode == 2 and "absent.json" in missing.stderr
