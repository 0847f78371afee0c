"""Settings vLLM would refuse are refused first, with the numbers: max_model_len against the model's
config.json, kv_cache_memory_bytes against one max-length request. No engine is started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragcache.config import ConfigError, EngineSettings, Settings
from ragcache.engine.limits import check_engine_limits, kv_bytes_per_request, read_kv_shape
from tests.conftest import REPO


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from ragcache.models import resolve_llm

    s = Settings.load()
    return resolve_llm(s.models.model, s.models.cache_dir).path


def test_the_default_settings_fit_the_default_model(model_dir):
    for dtype in ("float32", "bfloat16"):
        check_engine_limits(EngineSettings(), model_dir, dtype, block_size=128)


def test_one_request_needs_whole_blocks_of_every_layer_plus_the_null_block(model_dir):
    shape = read_kv_shape(model_dir)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.max_len) == (30, 3, 64, 8192)
    per_token = 2 * 30 * 3 * 64 * 4  # K and V, fp32
    assert kv_bytes_per_request(shape, 8192, "float32", 128) == per_token * 128 * (64 + 1)
    assert kv_bytes_per_request(shape, 8193, "float32", 128) == per_token * 128 * (65 + 1)
    assert kv_bytes_per_request(shape, 8192, "bfloat16", 16) == per_token // 2 * 16 * (512 + 1)


def test_a_cache_too_small_for_one_request_is_refused_with_the_numbers_and_the_fix(model_dir):
    with pytest.raises(ConfigError) as err:
        check_engine_limits(EngineSettings(kv_cache_memory_bytes=16 * 2**20), model_dir, "float32", block_size=128)
    msg = str(err.value)
    assert "engine.kv_cache_memory_bytes = 16777216 (16.0 MiB)" in msg and "max_model_len = 8192" in msg
    assert "383385600 bytes (365.6 MiB = 30 layers x 2 (K, V) x 3 KV heads x 64 x 4 bytes (float32)" in msg
    assert "set engine.kv_cache_memory_bytes >= 383385600 or engine.max_model_len <= 128" in msg
    need = 383385600
    check_engine_limits(EngineSettings(kv_cache_memory_bytes=need), model_dir, "float32", block_size=128)
    with pytest.raises(ConfigError):
        check_engine_limits(EngineSettings(kv_cache_memory_bytes=need - 1), model_dir, "float32", block_size=128)


def test_a_context_longer_than_the_model_allows_is_refused(model_dir, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    big = EngineSettings(max_model_len=100000, kv_cache_memory_bytes=2**40)
    with pytest.raises(ConfigError, match=r"engine.max_model_len = 100000 is above the model's maximum of 8192 "
                                          r"tokens \(max_position_embeddings in .*config.json\); set "
                                          r"engine.max_model_len <= 8192"):
        check_engine_limits(big, model_dir, "float32", block_size=128)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own override is honoured
    check_engine_limits(big, model_dir, "float32", block_size=128)


def test_rope_scaling_and_the_smallest_length_key_are_read_as_vllm_reads_them(tmp_path):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
           "max_position_embeddings": 4096, "seq_length": 2048, "rope_scaling": {"rope_type": "linear", "factor": 4}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = read_kv_shape(tmp_path)
    assert (shape.max_len, shape.max_len_key, shape.head_dim) == (8192, "seq_length", 16)
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4}  # yarn: already scaled in the config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_kv_shape(tmp_path).max_len == 2048


@pytest.mark.parametrize("env, words", [
    ({"RAGCACHE_ENGINE__KV_CACHE_MEMORY_BYTES": "16777216"}, "cannot hold one request of engine.max_model_len = 8192"),
    ({"RAGCACHE_ENGINE__MAX_MODEL_LEN": "100000"}, "is above the model's maximum of 8192 tokens"),
    ({"RAGCACHE_BLEND__CHECK_LAYER": "30"}, "blend.check_layer = 30, but the model has 30 layers (0 .. 29)"),
])
def test_ask_refuses_them_in_one_line_before_vllm_is_imported(tmp_path, env, words):
    section = next(iter(env)).split("__")[0].removeprefix("RAGCACHE_").lower()  # the error names the setting
    index = tmp_path / "idx"
    index.mkdir()
    build = {"chunk_size": 512, "chunk_overlap": 0, "llm": "smollm2-135m-instruct", "llm_fingerprint": "x",
             "embedding_model": "all-minilm-l6-v2", "dim": 384}
    (index / "manifest.json").write_text(json.dumps({"format": 1, "build": build, "files": {}, "docs": {}}))
    probe = ("import sys; from app.cli import main; code = main(sys.argv[1:]); "
             "print('EXIT', code, 'vllm' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe, "ask", "What is kelmet?", "--index", str(index)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert r.stdout.split()[-3:] == ["EXIT", "2", "False"], r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"ragcache: error: {section}.") and words in errors[0], errors
