"""ragcache.engine.ops and .selfcheck without an engine: the adapter registry, each adapter's family
hooks and refusals, RoPE through vLLM's rotary modules, the self-check's metric and the gate."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ragcache.engine.messages import OpsProbe
from ragcache.engine.ops import (
    ADAPTERS,
    HOW_TO_ADD,
    UnsupportedArchitectureError,
    VLLMLlamaOps,
    adapter_for,
    exercise,
    kv_layout,
    sliding_window,
)
from ragcache.engine.selfcheck import (
    TOLERANCES,
    BlendSupport,
    BlendUnavailableError,
    ContextBeyondWindowError,
    first_token_error,
    tolerance_for,
)

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 32, 64


def vllm_rope(rope_parameters: dict, max_position: int = 4096) -> nn.Module:
    """vLLM's own rotary module for ``rope_parameters`` (float32)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(HEAD_DIM, max_position, rope_parameters=rope_parameters, dtype=torch.float32)


class _Linear(nn.Linear):
    """A projection that returns ``(out, bias)`` like vLLM's parallel linear layers."""

    def forward(self, x):
        return super().forward(x), None


class _Attention(nn.Module):
    """Stands for vLLM's ``Attention`` (the paged-cache layer): no weights, the attributes read."""

    def __init__(self, window=None):
        super().__init__()
        self.impl, self.num_kv_heads, self.head_size, self.sliding_window = object(), KV_HEADS, HEAD_DIM, window
        self.attn_type = "decoder"


class _SelfAttn(nn.Module):
    def __init__(self, rotary, window=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = HEADS, KV_HEADS, HEAD_DIM
        self.q_size, self.kv_size, self.scaling = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, HEAD_DIM ** -0.5
        self.qkv_proj = _Linear(HIDDEN, self.q_size + 2 * self.kv_size)
        self.o_proj = _Linear(self.q_size, HIDDEN)
        self.rotary_emb = rotary
        self.attn = _Attention(window)


class _RMSNorm(nn.RMSNorm):
    """vLLM's ``RMSNorm`` calling convention: ``norm(x)`` or ``norm(x, residual) -> (norm(x + residual),
    x + residual)``."""

    def forward(self, x, residual=None):
        if residual is None:
            return super().forward(x)
        total = x + residual
        return super().forward(total), total


class _Layer(nn.Module):
    def __init__(self, rotary, window=None):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _RMSNorm(HIDDEN), _RMSNorm(HIDDEN)
        self.self_attn, self.mlp = _SelfAttn(rotary, window), nn.Linear(HIDDEN, HIDDEN)


def fake_model(architecture: str, rotary: nn.Module | None = None, layers: int = 2, window=None) -> nn.Module:
    """A module tree laid out like vLLM's Llama family, whose class is named ``architecture``."""
    rotary = rotary or vllm_rope({"rope_type": "default", "rope_theta": 1e4})
    inner = nn.Module()
    inner.embed_tokens = nn.Embedding(100, HIDDEN)
    inner.layers = nn.ModuleList([_Layer(rotary, window) for _ in range(layers)])
    model = type(architecture, (nn.Module,), {})()
    model.model = inner
    return model


def add_head_norms(model: nn.Module, factor: float = 2.0) -> None:
    """Give every attention layer ``q_norm`` / ``k_norm`` (here: multiply by ``factor``)."""
    for layer in model.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = _Scale(factor)


class _Scale(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


# ---- registry ----------------------------------------------------------------------------------

def test_registry_serves_llama_mistral_qwen2_qwen3_each_with_its_adapter():
    assert {name: cls.__name__ for name, cls in ADAPTERS.items()} == {
        "LlamaForCausalLM": "VLLMLlamaOps", "MistralForCausalLM": "VLLMMistralOps",
        "Qwen2ForCausalLM": "VLLMQwen2Ops", "Qwen3ForCausalLM": "VLLMQwen3Ops"}
    for name in ADAPTERS:
        model = fake_model(name)
        if name == "Qwen3ForCausalLM":
            add_head_norms(model)
        ops = adapter_for(model)
        assert type(ops) is ADAPTERS[name] and ops.num_layers == 2 and ops.num_kv_heads == KV_HEADS


def test_unregistered_architecture_raises_the_named_error_listing_what_is_supported():
    with pytest.raises(UnsupportedArchitectureError) as err:
        adapter_for(fake_model("GemmaForCausalLM"), hf_architectures=["GemmaForCausalLM"])
    message = str(err.value)
    assert message.startswith("GemmaForCausalLM: no DecoderOps adapter is registered")
    assert all(name in message for name in ADAPTERS)
    assert err.value.architecture == "GemmaForCausalLM" and HOW_TO_ADD.startswith("to add an adapter")


def test_hf_architecture_loaded_as_a_registered_class_is_named_in_errors():
    model = fake_model("LlamaForCausalLM")
    del model.model.layers[1].self_attn.qkv_proj
    with pytest.raises(UnsupportedArchitectureError,
                       match=r"InternLM3ForCausalLM \(loaded by vLLM as LlamaForCausalLM\).*layer 1 lacks self_attn.qkv_proj"):
        adapter_for(model, hf_architectures=["InternLM3ForCausalLM"])


def test_adapters_refuse_configurations_whose_kv_cannot_be_moved():
    mistral = fake_model("MistralForCausalLM")
    mistral.model.layers[0].self_attn.do_llama_4_scaling = True
    with pytest.raises(UnsupportedArchitectureError, match="llama_4_scaling"):
        adapter_for(mistral)
    qwen2 = fake_model("Qwen2ForCausalLM")
    qwen2.model.layers[0].self_attn.dual_chunk_attention_config = {"chunk_size": 8192}
    with pytest.raises(UnsupportedArchitectureError, match="dual-chunk"):
        adapter_for(qwen2)
    with pytest.raises(UnsupportedArchitectureError, match="q_norm / k_norm"):
        adapter_for(fake_model("Qwen3ForCausalLM"))  # no head norms
    encoder = fake_model("LlamaForCausalLM")
    encoder.model.layers[1].self_attn.attn.attn_type = "encoder_only"
    with pytest.raises(UnsupportedArchitectureError, match="non-causal"):
        adapter_for(encoder)


def test_qwen3_adapter_applies_the_head_norms_to_q_and_k_before_rope_and_leaves_v():
    qwen3 = fake_model("Qwen3ForCausalLM")
    add_head_norms(qwen3, factor=2.0)
    llama = VLLMLlamaOps(qwen3)  # the same weights read without the norms
    ops = adapter_for(qwen3)
    hidden = torch.randn(5, 2, HIDDEN)  # the adapters' residual stream: (hidden_states, residual)
    with torch.inference_mode():
        (q, k, v), (q0, k0, v0) = ops.qkv(1, hidden), llama.qkv(1, hidden)
    torch.testing.assert_close(q, 2 * q0)
    torch.testing.assert_close(k, 2 * k0)
    torch.testing.assert_close(v, v0)


def test_qwen2_adapter_applies_head_norms_only_when_the_config_asks():
    qwen2 = fake_model("Qwen2ForCausalLM")
    add_head_norms(qwen2, factor=3.0)
    ops, hidden = adapter_for(qwen2), torch.randn(3, 2, HIDDEN)
    with torch.inference_mode():
        q_plain, _, _ = ops.qkv(0, hidden)
        qwen2.model.layers[0].self_attn.qk_norm = True  # vLLM sets it from config.qk_norm
        q_normed, _, _ = ops.qkv(0, hidden)
    torch.testing.assert_close(q_normed, 3 * q_plain)


# ---- RoPE through vLLM's rotary modules --------------------------------------------------------

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 1e4},
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024},
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_scores_depend_only_on_relative_position_for_every_scaling(kind):
    # what makes moved KV exact: q.k after RoPE is the same when both move by the same offset
    ops = adapter_for(fake_model("LlamaForCausalLM", vllm_rope(ROPES[kind])))
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, HEADS, HEAD_DIM, generator=gen), torch.randn(6, KV_HEADS, HEAD_DIM, generator=gen)
    q_in, k_in = q.clone(), k.clone()
    base = torch.tensor([3, 10, 40, 90, 200, 500])

    def scores(offset):
        q_r, k_r = ops.rope(0, base + offset, q, k)
        return torch.einsum("ihd,jhd->hij", q_r[:, ::2], k_r)  # query heads 0, 2 over KV heads 0, 1

    reference = scores(0)
    for offset in (37, 2500):
        torch.testing.assert_close(scores(offset), reference, atol=2e-3, rtol=1e-4)
    assert torch.equal(q, q_in) and torch.equal(k, k_in)  # out of place
    _, k_only = ops.rope(0, base + 37, None, k)
    torch.testing.assert_close(k_only, ops.rope(0, base + 37, q, k)[1])


def test_scaled_rope_differs_from_plain_rope_at_the_same_positions():
    # the adapter rotates with the engine's module, so the scaling cannot be dropped silently
    plain = adapter_for(fake_model("LlamaForCausalLM", vllm_rope({"rope_type": "default", "rope_theta": 5e5})))
    scaled = adapter_for(fake_model("LlamaForCausalLM", vllm_rope(ROPES["llama3"])))
    k, positions = torch.randn(4, KV_HEADS, HEAD_DIM), torch.tensor([100, 200, 300, 400])
    assert not torch.allclose(plain.rope(0, positions, None, k)[1], scaled.rope(0, positions, None, k)[1], atol=1e-3)


def test_kv_layout_and_sliding_window_are_read_from_the_attention_layers():
    model = fake_model("AnyForCausalLM", layers=3, window=4096)
    assert kv_layout(model) == (3, KV_HEADS, HEAD_DIM, torch.float32)
    assert sliding_window(model) == 4096
    assert sliding_window(fake_model("AnyForCausalLM")) is None
    with pytest.raises(TypeError, match="no vLLM attention layers"):
        kv_layout(nn.Linear(2, 2))


# ---- the self-check's metric and the gate ------------------------------------------------------

def distribution(logits: list[float]) -> dict[int, float]:
    norm = math.log(sum(math.exp(x) for x in logits))
    return {i: x - norm for i, x in enumerate(logits)}


def test_first_token_error_is_zero_for_equal_logits_and_scale_free():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1000, generator=gen).tolist()
    assert first_token_error(distribution(logits), distribution(logits)) == pytest.approx(0.0, abs=1e-12)
    flat = [0.01 * x for x in logits]  # a near-uniform distribution (random tiny model)
    noisy = [x + 0.01 * 0.01 * n for x, n in zip(flat, torch.randn(1000, generator=gen).tolist())]
    assert first_token_error(distribution(flat), distribution(noisy)) == pytest.approx(0.01, rel=0.1)
    other = torch.randn(1000, generator=gen).tolist()
    assert first_token_error(distribution(logits), distribution(other)) == pytest.approx(math.sqrt(2), rel=0.1)


def test_first_token_error_needs_two_whole_vocabulary_distributions():
    with pytest.raises(ValueError, match="whole-vocabulary"):
        first_token_error({0: -0.1, 1: -2.0}, {0: -0.1})
    lowp = {0: -0.01, 1: -math.inf, 2: -5.0}
    assert first_token_error(lowp, dict(lowp)) == 0.0  # -inf (16-bit underflow) is clipped, not NaN


def test_tolerance_is_the_looser_of_the_compute_and_the_stored_kv_dtype():
    assert tolerance_for("float32") == TOLERANCES["float32"] < TOLERANCES["float16"] < TOLERANCES["bfloat16"]
    assert tolerance_for("float32", "bfloat16") == TOLERANCES["bfloat16"]  # a stored head is rounded to bf16
    assert tolerance_for("bfloat16", "float16") == TOLERANCES["bfloat16"]


def support(**kw) -> BlendSupport:
    base = {"architecture": "MistralForCausalLM", "hf_architectures": ("MistralForCausalLM",),
            "adapter": "VLLMMistralOps", "dtype": "float32", "sliding_window": None, "available": True}
    return BlendSupport(**{**base, **kw})


def test_gate_lets_everything_through_when_available_and_full_prefix_always():
    s = support()
    for mode in ("full", "prefix", "reuse", "blend", "precompute"):
        s.require(mode, 10_000)
    off = support(available=False, reason="reuse/blend ... disabled ... --mode full")
    off.require("full", 10)
    off.require("prefix", 10)
    for mode in ("reuse", "blend", "precompute"):
        with pytest.raises(BlendUnavailableError, match="disabled"):
            off.require(mode, 10)


def test_gate_refuses_contexts_beyond_the_sliding_window():
    s = support(sliding_window=4096)
    s.require("blend", 4096)  # exact: every context token still sees every earlier one
    with pytest.raises(ContextBeyondWindowError, match=r"4097 tokens.*window of 4096.*--mode full") as err:
        s.require("reuse", 4097)
    assert isinstance(err.value, BlendUnavailableError) and isinstance(err.value, ValueError)
    s.require("full", 100_000)


def test_ops_probe_round_trips_through_plain_data():
    probe = OpsProbe("LlamaForCausalLM", ("YiForCausalLM",), "VLLMLlamaOps", None, 4096, 0.25)
    assert OpsProbe.from_dict(probe.to_dict()) == probe
    assert probe.to_dict()["hf_architectures"] == ["YiForCausalLM"]


def test_exercise_calls_every_adapter_method_and_reports_failures():
    ops = adapter_for(fake_model("LlamaForCausalLM", layers=3))
    ids = torch.tensor([1, 5, 9, 2])
    exercise(ops, ids)  # a healthy adapter passes
    ops.layers[2].mlp = nn.Linear(HIDDEN, HIDDEN + 1)  # the last layer's MLP has the wrong width
    with pytest.raises(RuntimeError):
        exercise(ops, ids)
    ops.layers[2].mlp = nn.Linear(HIDDEN, HIDDEN)
    with torch.no_grad():
        ops.layers[0].self_attn.qkv_proj.weight[0, 0] = math.nan
    with pytest.raises(FloatingPointError, match="non-finite values in layer 0"):
        exercise(ops, ids)


# ---- the adapter's fused paths ------------------------------------------------------------------

@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_qkv_rope_rotates_where_the_projection_wrote_and_equals_qkv_then_rope(architecture):
    torch.manual_seed(0)
    model = fake_model(architecture, layers=2)
    if architecture == "Qwen3ForCausalLM":
        add_head_norms(model)
    ops = adapter_for(model)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    positions = torch.arange(40, 48)
    with torch.inference_mode():
        hidden = ops.embed(ids)
        q, k, v = ops.qkv(1, hidden)
        expected_q, expected_k = ops.rope(1, positions, q, k)
        got_q, got_k, got_v = ops.qkv_rope(1, hidden, positions)
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k) and torch.equal(got_v, v)


def test_keys_of_every_layer_move_in_one_call_as_layer_by_layer():
    torch.manual_seed(1)
    ops = adapter_for(fake_model("LlamaForCausalLM", layers=3))
    assert ops.rotate_keys_ is not None  # every layer shares one rotary module
    from ragcache.blend.rope import move_all_keys_, move_keys

    k_pre = torch.randn(3, 10, KV_HEADS, HEAD_DIM)
    positions = torch.arange(100, 110)
    expected = [move_keys(ops, layer, k_pre[layer], positions) for layer in range(3)]
    with torch.inference_mode():
        moved = move_all_keys_(ops, k_pre.clone(), positions)
    for layer in range(3):
        torch.testing.assert_close(moved[layer], expected[layer], rtol=0, atol=1e-6)
    own = fake_model("LlamaForCausalLM", layers=2)
    own.model.layers[1].self_attn.rotary_emb = vllm_rope({"rope_type": "default", "rope_theta": 5e4})
    assert adapter_for(own).rotate_keys_ is None  # layers that rotate differently are moved one by one


def test_finish_layer_takes_the_residual_its_qkv_left_and_adds_again_for_another_stream():
    torch.manual_seed(2)
    ops = adapter_for(fake_model("LlamaForCausalLM", layers=2))
    with torch.inference_mode():
        hidden = ops.embed(torch.tensor([7, 8, 9]))
        hidden = ops.finish_layer(0, hidden, torch.randn(3, HEADS, HEAD_DIM))  # a stream with a residual
        attn = torch.randn(3, HEADS, HEAD_DIM)
        ops.qkv(1, hidden)
        after_qkv = ops.finish_layer(1, hidden, attn)  # the residual the input norm computed
        fresh = ops.finish_layer(1, hidden.clone(), attn)  # another tensor: added again
    assert torch.equal(after_qkv, fresh)


def test_the_adapter_over_vllm_style_modules_computes_what_transformers_does():
    from hf_ops import hf_layer_kv, tiny_llama
    from vllm_style import vllm_style_llama

    from ragcache.blend import compute_kv, move_keys

    hf = tiny_llama()
    ops = VLLMLlamaOps(vllm_style_llama(hf))
    ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(50)
    k_pre, v = compute_kv(ops, ids, positions)
    expected = hf_layer_kv(hf, ids, positions)
    for layer in range(ops.num_layers):
        torch.testing.assert_close(move_keys(ops, layer, k_pre[layer], positions), expected[layer][0], atol=1e-5,
                                   rtol=1e-5)
        torch.testing.assert_close(v[layer], expected[layer][1], atol=1e-5, rtol=1e-5)
