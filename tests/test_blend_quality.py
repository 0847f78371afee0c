"""Blend quality on the real SmolLM2 with HotpotQA passages: blend is closer to full prefill than reuse.

Each passage's KV is computed alone after a fixed lead-in (the prompt's template head), the passages
are placed one after another, and the question is prefilled by transformers over the resulting
context KV. Quality is the first-token KL(full || mode), as DESIGN.md recommends for this model.
"""

import pytest
import torch
from hf_ops import HFLlamaOps, LayerCollector, cached_context, hotpotqa_examples, next_token_logits, smollm2

from blend_calls import blend_of

from ragcache.blend import reuse_kv

LEAD_IN = (
    "<|im_start|>system\nYou are a helpful assistant. Answer the question using the passages.<|im_end|>\n"
    "<|im_start|>user\n"
)
NUM_EXAMPLES = 3
NUM_PASSAGES = 3


@pytest.fixture(scope="module")
def smol():
    model, tokenizer = smollm2()
    return model, HFLlamaOps(model), tokenizer


def hotpot_prompt(tokenizer, example: dict) -> tuple[list[int], list[list[int]], list[int]]:
    """(lead-in ids, passage ids, question ids): the supporting passages first, then distractors."""
    supporting = set(example["supporting_facts"]["title"])
    ctxs = sorted(example["ctxs"], key=lambda c: c["title"] not in supporting)[:NUM_PASSAGES]
    passages = [tokenizer(f"{c['title']}: {c['text']}\n\n")["input_ids"] for c in ctxs]
    question = tokenizer(f"Question: {example['question']}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    return tokenizer(LEAD_IN)["input_ids"], passages, question


def kl_full_to(full_logits: torch.Tensor, mode_logits: torch.Tensor) -> float:
    """KL(full || mode) of the next-token distributions, in nats."""
    log_p = torch.log_softmax(full_logits.double(), dim=-1)
    log_q = torch.log_softmax(mode_logits.double(), dim=-1)
    return float((log_p.exp() * (log_p - log_q)).sum())


def full_prefill_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def test_reuse_of_one_passage_at_its_canonical_position_matches_full_prefill(smol):
    model, ops, tokenizer = smol
    lead_in, passages, question = hotpot_prompt(tokenizer, hotpotqa_examples()[0])
    context = cached_context(ops, lead_in, passages[:1])
    reused = LayerCollector(ops.num_layers)
    reuse_kv(ops, context.positions, context.load_layer, reused)
    logits = next_token_logits(model, reused.k, reused.v, torch.tensor(question))
    full = full_prefill_logits(model, lead_in + passages[0] + question)
    torch.testing.assert_close(logits, full, atol=2e-3, rtol=1e-3)
    assert kl_full_to(full, logits) < 1e-6


def test_blend_first_token_distribution_is_closer_to_full_prefill_than_reuse(smol):
    model, ops, tokenizer = smol
    kl_reuse, kl_blend = [], []
    for example in hotpotqa_examples()[:NUM_EXAMPLES]:
        lead_in, passages, question = hotpot_prompt(tokenizer, example)
        context = cached_context(ops, lead_in, passages)
        full = full_prefill_logits(model, context.token_ids.tolist() + question)

        reused = LayerCollector(ops.num_layers)
        reuse_kv(ops, context.positions, context.load_layer, reused)
        kl_reuse.append(kl_full_to(full, next_token_logits(model, reused.k, reused.v, torch.tensor(question))))

        blended = LayerCollector(ops.num_layers)
        result = blend_of(
            ops, context.token_ids, context.positions, context.load_layer,
            recompute_ratio=0.15, check_layer=1, deviation="value", on_layer=blended,
        )
        assert result.num_recomputed > 0
        kl_blend.append(kl_full_to(full, next_token_logits(model, blended.k, blended.v, torch.tensor(question))))

    mean_reuse = sum(kl_reuse) / len(kl_reuse)
    mean_blend = sum(kl_blend) / len(kl_blend)
    print(f"\nKL(full || reuse) per prompt {[round(x, 4) for x in kl_reuse]}, mean {mean_reuse:.4f}")
    print(f"KL(full || blend r=0.15) per prompt {[round(x, 4) for x in kl_blend]}, mean {mean_blend:.4f}")
    assert mean_blend < mean_reuse


FACTS = [
    "The river Aster runs through the old town, past the fish market and the glass-blowers' quarter.",
    "The Amber Hall, where the Zorbian parliament meets, has 212 seats and a copper roof built in 1788.",
    "Winters in the northern valleys are long; shepherds move their flocks to the coast in October.",
    "The national dish is kelmet, a stew of lentils, smoked fish and saffron served on holidays.",
]
ASKS = ["Which quarter does the river Aster pass?", "How many seats does the Amber Hall have?",
        "When do shepherds move their flocks to the coast?", "What is kelmet made of?"]


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [2, 3, 0, 1]])
def test_question_selection_spends_more_budget_on_the_chunk_the_question_asks_about(smol, order):
    """Each question names a phrase found in one chunk only. The chunks have the same length and the
    same place in every prompt, so a chunk's share of the budget can only change with the question:
    it must be larger when the question asks about that chunk than when it asks about another one.
    (Across places the comparison is confounded: on this model the question's attention favours the
    chunks nearest to it, whatever they say.)"""
    from ragcache.blend import Selection

    model, ops, tokenizer = smol
    units = [tokenizer(FACTS[i] + "\n\n", add_special_tokens=False)["input_ids"] for i in order]
    length = min(len(u) for u in units)
    units = [u[:length] for u in units]
    lead_in = tokenizer(LEAD_IN, add_special_tokens=False)["input_ids"]
    context = cached_context(ops, lead_in, units)
    exact = torch.zeros(context.token_ids.shape[0], dtype=torch.bool)
    exact[:context.chunk_starts[1]] = True  # lead-in and first chunk sit where they were computed
    counts = {}  # fact asked about -> selected tokens per chunk place
    for fact, question in enumerate(ASKS):
        tail = tokenizer(f"Question: {question}<|im_end|>\n<|im_start|>assistant\n",
                         add_special_tokens=False)["input_ids"]
        result = blend_of(ops, context.token_ids, context.positions, context.load_layer, recompute_ratio=0.15,
                          check_layer=1, deviation="value", selection=Selection("question"),
                          tail_ids=torch.tensor(tail), segment_starts=[0] + context.chunk_starts, exact=exact,
                          on_layer=LayerCollector(ops.num_layers))
        picked = result.selected.tolist()
        counts[fact] = [sum(start <= i < start + length for i in picked) for start in context.chunk_starts]
    print(f"\nselected per chunk place, by the fact asked about: {counts}")
    for place in (1, 2, 3):  # place 0 is exact: never selected at this ratio
        asked = order[place]
        others = [counts[f][place] for f in range(len(FACTS)) if f != asked]
        assert counts[asked][place] > max(others), (place, counts)
