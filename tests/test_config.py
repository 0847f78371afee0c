"""Settings: precedence settings.toml < RAGCACHE_* env < explicit args, and clear errors."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from ragcache.config import ConfigError, Settings

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for name in list(__import__("os").environ):
        if name.startswith("RAGCACHE_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no ./settings.toml unless a test writes one


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


def test_defaults_match_documented_settings_toml():
    documented = tomllib.loads((REPO / "settings.toml").read_text())
    defaults = Settings.load().model_dump(mode="json")
    for section, values in documented.items():
        assert section in defaults, f"settings.toml section [{section}] is not a Settings field"
        for key, value in values.items():
            assert defaults[section][key] == value, f"{section}.{key}: toml {value!r} != default"
    # every field is documented (commented-out lines count for paths under the cache home)
    text = (REPO / "settings.toml").read_text()
    for section, values in defaults.items():
        for key in values:
            assert f"{key} =" in text, f"{section}.{key} missing from settings.toml"


def test_seed_names_exist():
    s = Settings.load()
    for name in ("gpu_kv_pool_gb", "cpu_kv_pool_gb", "ssd_cache_dir", "ssd_cache_max_gb", "remote_url",
                 "eviction_policy", "enable_hit_rate_log", "log_interval_sec"):
        assert hasattr(s.store, name)
    assert s.blend.recompute_ratio == 0.15 and s.blend.pipeline_overlap == "auto"
    assert s.ingest.chunk_size == 512 and s.retrieval.top_k == 5
    assert s.engine.max_model_len > 0 and s.engine.kv_cache_memory_bytes > 0


def test_precedence_toml_then_env_then_args(tmp_path, monkeypatch):
    path = write(tmp_path, "[store]\ncpu_kv_pool_gb = 1.5\nssd_cache_max_gb = 7\n[retrieval]\ntop_k = 3\n")
    s = Settings.load(path)
    assert (s.store.cpu_kv_pool_gb, s.store.ssd_cache_max_gb, s.retrieval.top_k) == (1.5, 7, 3)

    monkeypatch.setenv("RAGCACHE_STORE__CPU_KV_POOL_GB", "2.5")
    s = Settings.load(path)
    assert s.store.cpu_kv_pool_gb == 2.5 and s.store.ssd_cache_max_gb == 7  # env wins, toml kept

    s = Settings.load(path, store={"cpu_kv_pool_gb": 3.5})
    assert s.store.cpu_kv_pool_gb == 3.5 and s.store.ssd_cache_max_gb == 7  # args win, merged per key
    assert s.retrieval.top_k == 3


def test_settings_file_from_env_and_cwd(tmp_path, monkeypatch):
    path = write(tmp_path, "[blend]\nrecompute_ratio = 0.3\n")
    monkeypatch.setenv("RAGCACHE_SETTINGS_FILE", str(path))
    assert Settings.load().blend.recompute_ratio == 0.3
    monkeypatch.delenv("RAGCACHE_SETTINGS_FILE")
    (tmp_path / "settings.toml").write_text("[blend]\nrecompute_ratio = 0.05\n")
    assert Settings.load().blend.recompute_ratio == 0.05


@pytest.mark.parametrize(
    "toml, words",
    [
        ("[store]\ncpu_kv_pool_gb = -1\n", ["store.cpu_kv_pool_gb", "-1", "must be >= 0"]),
        ("[blend]\nrecompute_depth = 0\n", ["blend.recompute_depth", "0", "must be in (0, 1]"]),
        ("[blend]\nrecompute_depth = 1.5\n", ["blend.recompute_depth", "1.5", "must be in (0, 1]"]),
        ("[retrieval]\ntop_k = 0\n", ["retrieval.top_k", "0", "must be in [1, 100]"]),
        ("[store]\nssd_cache_max_gb = -0.5\n", ["store.ssd_cache_max_gb", "-0.5"]),
        ("[blend]\nrecompute_ratio = 1.5\n", ["blend.recompute_ratio", "1.5", "must be in [0, 1] (or 'auto')"]),
        ("[blend]\nrecompute_ratio = \"fast\"\n", ["blend.recompute_ratio", "fast", "a number in [0, 1] or 'auto'"]),
        ("[blend]\nselection = \"attention\"\n", ["blend.selection", "attention", "'deviation', 'question' or 'hybrid'"]),
        ("[blend]\nrecompute_ratio = -0.1\n", ["blend.recompute_ratio", "-0.1"]),
        ("[store]\neviction_policy = \"fifo\"\n", ["store.eviction_policy", "fifo", "'lru' or 'lfu'"]),
        ("[store]\nremote_url = \"http://x\"\n", ["store.remote_url", "redis://"]),
        ("[engine]\nmode = \"fast\"\n", ["engine.mode", "fast", "'blend'"]),
        ("[ingest]\nchunk_size = 0\n", ["ingest.chunk_size", "0"]),
        ("[store]\ncpu_kv_pool = 1\n", ["unknown setting", "store.cpu_kv_pool"]),
    ],
)
def test_invalid_values_name_key_value_and_range(tmp_path, toml, words):
    with pytest.raises(ConfigError) as err:
        Settings.load(write(tmp_path, toml))
    for w in words:
        assert w in str(err.value)


def test_invalid_env_value_names_variable(monkeypatch):
    monkeypatch.setenv("RAGCACHE_BLEND__RECOMPUTE_RATIO", "2")
    with pytest.raises(ConfigError, match="RAGCACHE_BLEND__RECOMPUTE_RATIO"):
        Settings.load()


@pytest.mark.parametrize(("raw", "value"), [("auto", "auto"), ("false", False), ("true", True), ("0", False)])
def test_pipeline_overlap_is_auto_or_a_boolean(monkeypatch, raw, value):
    monkeypatch.setenv("RAGCACHE_BLEND__PIPELINE_OVERLAP", raw)
    assert Settings.load().blend.pipeline_overlap == value and type(Settings.load().blend.pipeline_overlap) is type(value)


def test_pipeline_overlap_rejects_other_words(monkeypatch):
    monkeypatch.setenv("RAGCACHE_BLEND__PIPELINE_OVERLAP", "sometimes")
    with pytest.raises(ConfigError, match="RAGCACHE_BLEND__PIPELINE_OVERLAP"):
        Settings.load()


def test_older_precompute_kv_is_read_as_ingest_kv_and_a_contradiction_is_refused(tmp_path, monkeypatch):
    assert Settings.load().ingest.kv == "eager"
    (tmp_path / "settings.toml").write_text("[ingest]\nprecompute_kv = false\n")  # a settings file of before
    assert Settings.load().ingest.kv == "lazy"
    monkeypatch.setenv("RAGCACHE_INGEST__PRECOMPUTE_KV", "true")
    (tmp_path / "settings.toml").write_text("[ingest]\nkv = \"eager\"\n")
    assert Settings.load().ingest.kv == "eager"
    monkeypatch.setenv("RAGCACHE_INGEST__PRECOMPUTE_KV", "0")
    with pytest.raises(ConfigError, match=r"precompute_kv = false .* and kv = 'eager' disagree: set kv = 'lazy'"):
        Settings.load()
    monkeypatch.setenv("RAGCACHE_INGEST__PRECOMPUTE_KV", "sometimes")
    with pytest.raises(ConfigError, match="must be true or false"):
        Settings.load()


def test_unreadable_toml_names_file(tmp_path):
    path = write(tmp_path, "[store\ncpu_kv_pool_gb = ")
    with pytest.raises(ConfigError, match="cannot read settings file .*s.toml"):
        Settings.load(path)
    with pytest.raises(ConfigError, match="does not exist"):
        Settings.load(tmp_path / "missing.toml")


def test_check_layer_auto_resolves_per_selection_and_zero_is_refused_for_deviation():
    from ragcache.config import BlendSettings, ConfigError, Settings

    assert BlendSettings().check_layer == "auto"
    assert BlendSettings(selection="question").resolved_check_layer == 0
    assert BlendSettings(selection="deviation").resolved_check_layer == 1
    assert BlendSettings(selection="hybrid", check_layer=3).resolved_check_layer == 3
    assert BlendSettings(selection="hybrid", question_weight=1.0, check_layer=0).resolved_check_layer == 0
    with pytest.raises(ConfigError, match=r"invalid settings in \[blend\]: check_layer = 0 with selection 'deviation'"):
        Settings.load(blend={"check_layer": 0, "selection": "deviation"})
    with pytest.raises(ConfigError, match="layer index >= 0 or 'auto'"):
        Settings.load(blend={"check_layer": "first"})


def test_layer_settings_are_checked_against_the_model_at_start():
    """A check layer past the model's layers is refused (for any selection a request may pick); a
    refine layer at or past the last recomputed layer is a warning (no cut is made there)."""
    from ragcache.config import BlendSettings, ConfigError

    assert BlendSettings().check_model_layers(30) == []
    assert BlendSettings(check_layer=29, selection="deviation").check_model_layers(30) == []
    with pytest.raises(ConfigError, match=r"^blend.check_layer = 30, but the model has 30 layers \(0 .. 29\); set "
                                          r"blend.check_layer below 30$"):
        BlendSettings(check_layer=30).check_model_layers(30)
    with pytest.raises(ConfigError, match="blend.check_layer = 'auto' is layer 1 for selection 'deviation', but the "
                                          "model has 1 layers"):
        BlendSettings().check_model_layers(1)  # "auto" is layer 1 for deviation
    [warning] = BlendSettings(refine_layer=30).check_model_layers(30)
    assert "blend.refine_layer = 30 is at or past the last layer the recomputed tokens go through (30" in warning
    assert BlendSettings(refine_layer=29).check_model_layers(30) == []
    assert BlendSettings(refine_layer=30, candidates=1).check_model_layers(30) == []  # no cut to make
    # with recompute_depth the recomputed tokens stop after ceil(depth x layers)
    assert BlendSettings(refine_layer=14, recompute_depth=0.5).check_model_layers(30) == []
    [warning] = BlendSettings(refine_layer=15, recompute_depth=0.5).check_model_layers(30)
    assert "(15 of the model's 30)" in warning


def test_a_request_selection_gets_its_own_check_layer():
    """A request that selects otherwise than the settings gets the check layer of its own strategy
    ("auto": 0 for question, 1 for deviation); a deviation request under an explicit check_layer 0
    is refused with the reason."""
    from ragcache.config import BlendKnobs, BlendSettings
    from ragcache.engine.messages import BlendParams
    from ragcache.options import QueryOptions

    def params(blend: BlendSettings, selection: str | None) -> BlendKnobs:
        return BlendParams.from_options(blend, QueryOptions(mode="blend", selection=selection), mode="blend",
                                        ctx_len=10, lead_in_len=1, segments=()).blend

    assert params(BlendSettings(), None).check_layer == 0
    assert params(BlendSettings(), "deviation").check_layer == 1
    assert (params(BlendSettings(selection="deviation"), "question/16").check_layer,
            params(BlendSettings(selection="deviation"), "question/16").granule) == (0, 16)
    assert params(BlendSettings(check_layer=2), "deviation").check_layer == 2
    with pytest.raises(ValueError, match="KV deviation at layer 0 is zero"):
        params(BlendSettings(check_layer=0), "deviation")
