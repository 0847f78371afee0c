"""Engine-agnostic CacheBlend math on torch tensors (Yao et al., EuroSys'25).

Owns: moving pre-RoPE chunk K to new positions, exact causal attention by absolute position,
HKVD token selection, the recomputed tokens' corrections spread to the reused ones
(:mod:`ragcache.blend.propagate`), and the layer-wise forwards (chunk KV precompute, blend, reuse)
over a model's own per-layer callables (``DecoderOps``).
Must not import vLLM or transformers, nor anything above it in ragcache: an engine adapter
implements ``DecoderOps`` and hands tensors and callables in.
"""

from ragcache.blend.attention import (
    Attention, CausalPlan, causal_attention, causal_plan, expand_kv_heads, masked_attention, torch_attention,
)
from ragcache.blend.forward import (
    BlendRequest, BlendResult, LeadInKV, LeadIns, OnLayer, WriteRows, blend_batch, blend_kv, compute_kv, decide_budgets,
    lead_in_kv, reuse_kv,
)
from ragcache.blend.plan import BlendPlan, plan_blend, recompute_layers
from ragcache.blend.propagate import Propagation, spread_corrections
from ragcache.blend.reused import CachedKV, LoadLayer, LoadOnCaller
from ragcache.blend.ops import DecoderOps
from ragcache.blend.rope import move_keys
from ragcache.blend.select import (
    SCORES,
    Budget,
    BudgetRule,
    Selection,
    TokenScores,
    adaptive_budget,
    deviation_scores,
    hkvd_budget,
    impact_scores,
    value_error,
    question_attention,
    score_function,
    select_hkvd,
    select_tokens,
)

__all__ = [
    "SCORES",
    "TokenScores",
    "score_function",
    "Attention",
    "masked_attention",
    "torch_attention",
    "BlendPlan",
    "BlendRequest",
    "BlendResult",
    "CachedKV",
    "Budget",
    "BudgetRule",
    "Selection",
    "adaptive_budget",
    "deviation_scores",
    "impact_scores",
    "value_error",
    "question_attention",
    "select_tokens",
    "DecoderOps",
    "LoadLayer",
    "LoadOnCaller",
    "OnLayer",
    "WriteRows",
    "blend_batch",
    "blend_kv",
    "decide_budgets",
    "plan_blend",
    "recompute_layers",
    "CausalPlan",
    "causal_attention",
    "causal_plan",
    "compute_kv",
    "lead_in_kv",
    "LeadInKV",
    "LeadIns",
    "expand_kv_heads",
    "hkvd_budget",
    "move_keys",
    "reuse_kv",
    "Propagation",
    "spread_corrections",
    "select_hkvd",
]
