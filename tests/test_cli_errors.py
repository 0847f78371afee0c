"""Every bad input a new user tried: one line naming the problem and the fix, exit status 2, no
traceback (``-v`` shows it), before any engine starts. The engine-limit cases (kv_cache_memory_bytes,
max_model_len) are in tests/test_engine_limits.py, the ingest paths and index folders in
tests/test_ingest.py; the ones that need an answer from the engine (a too-long question) in
tests/test_pipeline.py."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from tests.conftest import clear_ragcache_env

BUILD = {"chunk_size": 512, "chunk_overlap": 0, "llm": "smollm2-135m-instruct", "llm_fingerprint": "x",
         "embedding_model": "all-minilm-l6-v2", "dim": 384}


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    clear_ragcache_env(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAGCACHE_STORE__SSD_CACHE_DIR", str(tmp_path / "kv"))
    index = tmp_path / "indexes" / "idx"  # an index folder as ingest writes it (only its manifest is read)
    index.mkdir(parents=True)
    (index / "manifest.json").write_text(json.dumps({"format": 1, "build": BUILD, "files": {}, "docs": {}}))
    (tmp_path / "doc.txt").write_text("Zorbia's capital is Velmora.")
    (tmp_path / "bad.toml").write_text("[store\ncpu_kv_pool_gb = ")
    (tmp_path / "unknown.toml").write_text("[store]\ncpu_kv_pool = 1\n")
    (tmp_path / "notjson").mkdir()
    (tmp_path / "notjson" / "manifest.json").write_text("{not json")


#: (case, argv, environment, words the one line must contain)
CASES = [
    ("empty question", ["ask", ""], {}, "the question is empty"),
    ("blank question", ["ask", "   "], {}, "the question is empty"),
    ("section env var not JSON", ["ask", "q?"], {"RAGCACHE_STORE": "{bad"},
     "cannot parse environment variable RAGCACHE_STORE='{bad'"),
    ("--top-k above the settings' cap", ["ask", "q?", "--top-k", "100000"], {},
     "--top-k 100000: must be in [1, 100] (the range of the setting retrieval.top_k)"),
    ("--top-k 0", ["ask", "q?", "--top-k", "0"], {}, "--top-k 0: must be in [1, 100]"),
    ("--top-k negative in chat", ["chat", "--top-k", "-3"], {}, "--top-k -3: must be in [1, 100]"),
    ("--top-k not a number", ["ask", "q?", "--top-k", "abc"], {}, "argument --top-k: invalid int value: 'abc'"),
    ("--max-tokens 0", ["ask", "q?", "--max-tokens", "0"], {}, "--max-tokens 0: must be >= 1"),
    ("--recompute-ratio 2", ["ask", "q?", "--recompute-ratio", "2"], {},
     "--recompute-ratio 2.0: must be in [0, 1]"),
    ("--recompute-ratio negative", ["ask", "q?", "--recompute-ratio", "-0.1"], {}, "must be in [0, 1]"),
    ("--recompute-ratio neither a number nor auto", ["ask", "q?", "--recompute-ratio", "most"], {},
     "argument --recompute-ratio: 'most': expected a number in [0, 1] or 'auto'"),
    ("unknown --mode", ["ask", "q?", "--mode", "fast"], {}, "argument --mode: invalid choice: 'fast'"),
    ("--recompute-ratio with --mode full", ["ask", "q?", "--mode", "full", "--recompute-ratio", "0.3"], {},
     "--recompute-ratio 0.3: applies in blend or auto mode only, and the request's mode is 'full'"),
    ("--mass-left with --mode reuse", ["chat", "--mode", "reuse", "--mass-left", "0.1"], {},
     "--mass-left 0.1: applies in blend or auto mode only, and the request's mode is 'reuse'"),
    ("--recompute-ratio auto with --mode prefix", ["ask", "q?", "--mode", "prefix", "--recompute-ratio", "auto"], {},
     "--recompute-ratio auto: applies in blend or auto mode only, and the request's mode is 'prefix'"),
    ("--recompute-ratio under engine.mode full", ["ask", "q?", "--recompute-ratio", "0.3"],
     {"RAGCACHE_ENGINE__MODE": "full"}, "--recompute-ratio 0.3: applies in blend or auto mode only, and the "
     "request's mode is 'full' (no mode given: the setting engine.mode): drop it, or ask in blend mode"),
    ("--selection under engine.mode reuse in chat", ["chat", "--selection", "question"],
     {"RAGCACHE_ENGINE__MODE": "reuse"}, "--selection question: applies in blend or auto mode only, and the "
     "request's mode is 'reuse' (no mode given: the setting engine.mode)"),
    ("--budget fixed with --mass-left", ["ask", "q?", "--budget", "fixed", "--mass-left", "0.01"], {},
     "--mass-left 0.01: sets the adaptive budget's threshold, and the request's budget is 'fixed'"),
    ("--selection deviation with --mass-left", ["ask", "q?", "--selection", "deviation", "--mass-left", "0.01"], {},
     "--mass-left 0.01: sets the adaptive budget's threshold on the question's attention, and the request's "
     "selection 'deviation' does not read it"),
    ("--selection deviation with --budget adaptive", ["chat", "--selection", "deviation", "--budget", "adaptive"], {},
     "--budget adaptive: the adaptive budget follows the question's attention, and the request's selection "
     "'deviation' does not read it"),
    ("--mass-left under blend.selection deviation", ["ask", "q?", "--mass-left", "0.01"],
     {"RAGCACHE_BLEND__SELECTION": "deviation"}, "--mass-left 0.01: sets the adaptive budget's threshold on the "
     "question's attention, and the selection 'deviation' (no selection given: the setting blend.selection)"),
    ("--mass-left not a number", ["ask", "q?", "--mass-left", "some"], {}, "argument --mass-left: invalid float value"),
    ("unknown --budget", ["ask", "q?", "--budget", "some"], {}, "argument --budget: invalid choice: 'some'"),
    ("unknown --selection", ["ask", "q?", "--selection", "attention"], {},
     "--selection strategy attention: Input should be 'deviation', 'question' or 'hybrid'"),
    ("--selection granule out of range", ["ask", "q?", "--selection", "question/0"], {},
     "--selection granule 0: must be in [1, 256]"),
    ("unknown command", ["frob"], {}, "invalid choice: 'frob'"),
    ("missing index", ["ask", "q?", "--index", "nope"], {}, "run `ragcache ingest PATH --index nope` first"),
    ("calibrate of a missing index", ["calibrate", "--index", "nope", "--selection", "question"], {},
     "run `ragcache ingest PATH --index nope` first"),
    ("empty index name", ["ask", "q?", "--index", ""], {}, "is not an index name"),
    ("index name ..", ["ask", "q?", "--index", ".."], {}, "is not an index name"),
    ("damaged manifest", ["ask", "q?", "--index", "./notjson"], {}, "the index is damaged: delete notjson"),
    ("settings file missing", ["--settings", "missing.toml", "ask", "q?"], {},
     "settings file missing.toml does not exist"),
    ("settings file not TOML", ["--settings", "bad.toml", "ask", "q?"], {}, "cannot read settings file bad.toml"),
    ("unknown setting", ["--settings", "unknown.toml", "cache", "stats"], {}, "unknown setting 'store.cpu_kv_pool'"),
    ("RAGCACHE_SETTINGS_FILE missing", ["cache", "stats"], {"RAGCACHE_SETTINGS_FILE": "/no/such.toml"},
     "does not exist; create it or unset RAGCACHE_SETTINGS_FILE"),
    ("setting out of range", ["ask", "q?"], {"RAGCACHE_BLEND__RECOMPUTE_RATIO": "2"},
     "invalid setting blend.recompute_ratio = '2'"),
    ("setting not a number", ["ask", "q?"], {"RAGCACHE_ENGINE__MAX_MODEL_LEN": "lots"},
     "engine.max_model_len = 'lots'"),
    ("unknown engine.mode", ["ask", "q?"], {"RAGCACHE_ENGINE__MODE": "fast"}, "engine.mode = 'fast'"),
    ("Redis URL of another scheme", ["cache", "stats"], {"RAGCACHE_STORE__REMOTE_URL": "http://x"},
     "must start with redis://"),
    ("Redis URL with a bad port", ["cache", "stats"], {"RAGCACHE_STORE__REMOTE_URL": "redis://localhost:abc/0"},
     "port that is not a number"),
    ("namespace setting with a space", ["cache", "stats"], {"RAGCACHE_STORE__NAMESPACE": "a b"},
     "store.namespace = 'a b'"),
    ("--namespace with a space", ["ingest", "doc.txt", "--namespace", "a b"], {}, "--namespace 'a b'"),
    ("cache clear --namespace with a slash too many", ["cache", "clear", "--namespace", "a/b/c"], {},
     "--namespace 'b/c'"),
    ("cache drop of a missing index", ["cache", "drop", "--index", "nope"], {}, "no index at indexes/nope"),
    ("model that does not exist", ["ask", "q?", "--index", "idx"], {"RAGCACHE_MODELS__MODEL": "/no/such/model"},
     "model '/no/such/model' is neither a known alias"),
    ("chunk_overlap not below chunk_size", ["ingest", "doc.txt", "--no-kv"],
     {"RAGCACHE_INGEST__CHUNK_SIZE": "64", "RAGCACHE_INGEST__CHUNK_OVERLAP": "64"},
     "ingest.chunk_overlap = 64: must be smaller than ingest.chunk_size (64)"),
    ("--actors below 0", ["ingest", "doc.txt", "--executor", "ray", "--actors", "-1"], {},
     "--actors -1: must be in [0, 4096] (the range of the setting ingest.ray_actors)"),
    ("--actors without the Ray executor", ["ingest", "doc.txt", "--actors", "2"], {},
     "--actors 2 sizes the pools of --executor ray"),
    ("the older precompute_kv against ingest.kv", ["ingest", "doc.txt"],
     {"RAGCACHE_INGEST__PRECOMPUTE_KV": "false", "RAGCACHE_INGEST__KV": "eager"}, "disagree: set kv = 'lazy'"),
]


@pytest.mark.parametrize("argv, env, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_one_line_with_the_fix_and_exit_status_2(monkeypatch, capsys, argv, env, words):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        code = main(argv)
    except SystemExit as exc:  # usage errors leave through argparse, as `ragcache` itself exits
        code = exc.code
    assert code == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("ragcache: error: ") and words in lines[0], lines[0]
    assert "Traceback" not in err and "Traceback" not in out


def test_verbose_shows_the_traceback_of_a_user_error(capsys):
    assert main(["-v", "ask", "  "]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "EmptyQuestionError" in err
    assert err.rstrip().splitlines()[-1] == "ragcache: error: the question is empty; ask something"



def test_recompute_ratio_auto_on_the_command_line_is_the_setting_for_this_run():
    """``--recompute-ratio auto`` is not a per-request ratio: the request keeps none, and the run's
    settings say ``blend.recompute_ratio = "auto"`` (the index's calibration, else the fallback),
    every other blend setting as the settings file has it."""
    from app.ask_cmd import query_options, run_settings
    from app.cli import build_parser

    args = build_parser().parse_args(["ask", "q?", "--recompute-ratio", "AUTO"])
    assert query_options(args).recompute_ratio is None
    settings = run_settings(args)
    assert settings.blend.recompute_ratio == "auto" and settings.blend.granule == 8
    fixed = build_parser().parse_args(["ask", "q?", "--recompute-ratio", "0.3"])
    assert query_options(fixed).recompute_ratio == 0.3 and run_settings(fixed).blend.recompute_ratio == 0.15
