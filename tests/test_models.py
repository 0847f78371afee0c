"""Model provisioning: the packaged GGUF is converted once, reused afterwards, and vLLM runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragcache.models import (
    MARKER,
    ModelNotFoundError,
    resolve_embedding_model,
    resolve_llm,
)


@pytest.mark.integration
def test_packaged_gguf_is_converted_once_then_reused(tmp_path):
    first = resolve_llm("smollm2-135m-instruct", tmp_path)
    assert first.converted is True
    assert (first.path / "config.json").is_file() and (first.path / MARKER).is_file()
    cfg = json.loads((first.path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert list(first.path.glob("*.safetensors"))
    mtime = (first.path / "config.json").stat().st_mtime_ns

    second = resolve_llm("smollm2-135m-instruct", tmp_path)
    assert second.converted is False
    assert second.path == first.path and second.fingerprint == first.fingerprint
    assert (second.path / "config.json").stat().st_mtime_ns == mtime
    # no temporary folders or half models left beside it
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".") or p.is_dir()] == [first.path.name]


def test_hf_folder_path_is_used_as_is(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    info = resolve_llm(str(folder), tmp_path / "cache")
    assert info.path == folder.resolve() and info.converted is False and len(info.fingerprint) == 16
    (folder / "model.safetensors").write_bytes(b"\1" * 64)
    assert resolve_llm(str(folder), tmp_path / "cache").fingerprint != info.fingerprint


def test_unknown_model_names_the_setting(tmp_path):
    with pytest.raises(ModelNotFoundError, match="models.model"):
        resolve_llm("no-such-model", tmp_path)
    with pytest.raises(ModelNotFoundError, match="models.embedding_model"):
        resolve_embedding_model("no-such-embedder")


def test_embedding_model_resolves_to_packaged_folder():
    folder = resolve_embedding_model("all-minilm-l6-v2")
    assert (folder / "config.json").is_file() and (folder / "modules.json").is_file()


@pytest.mark.integration
def test_vllm_answers_capital_of_france(engine):
    """The converted model runs on vLLM (CPU build, enforce_eager) and answers greedily."""
    from vllm import SamplingParams

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = engine.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_package_import_does_not_import_vllm_or_app():
    code = ("import sys, ragcache, ragcache.config, ragcache.models, ragcache.chunks, ragcache.prompt;"
            "bad=[m for m in sys.modules if m=='vllm' or m.startswith(('vllm.','app.','ui.'))];"
            "print(bad); sys.exit(1 if bad else 0)")
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stdout + r.stderr
