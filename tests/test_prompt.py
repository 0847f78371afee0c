"""Prompt assembly (ragcache.prompt) with the real SmolLM2 tokenizer: spans, keys, the placement rule, limits."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from ragcache.chunks import Chunk, chunk_id_for
from ragcache.config import PromptSettings, Settings
from ragcache.models import encode, resolve_llm
from ragcache.prompt import KV_CONTEXT_FILE, PromptBuilder, PromptTooLongError, is_canonical, lead_in_for

TEXTS = ["Velmora is the capital of Zorbia.", "The Amber Hall has 212 seats and a copper roof.",
         "Kelmet is a stew of lentils, smoked fish and saffron."]


@pytest.fixture(scope="module")
def tokenizer():
    s = Settings.load()
    return AutoTokenizer.from_pretrained(str(resolve_llm(s.models.model, s.models.cache_dir).path))


@pytest.fixture(scope="module")
def chunks(tokenizer):
    return [Chunk(chunk_id_for(t), f"doc{i}", "", 0, t, tuple(encode(tokenizer, t))) for i, t in enumerate(TEXTS)]


def builder(tokenizer, max_len=None, fingerprint="fp0", **prompt):
    return PromptBuilder(tokenizer, PromptSettings(**prompt), fingerprint, max_len=max_len)


def test_segments_cover_the_context_contiguously_and_the_tail_follows(tokenizer, chunks):
    b = builder(tokenizer)
    p = b.build("Where does the parliament meet?", chunks)
    assert p.segments[0] == b.head and p.segments[0].start == 0 and p.lead_in_len == len(b.head_ids)
    pos = 0
    for seg in p.segments:
        assert seg.start == pos
        pos += seg.length
    assert pos == p.ctx_len and p.tail_len == len(p.token_ids) - p.ctx_len > 0
    for seg, chunk in zip(p.segments[1:], chunks):
        assert seg.chunk_id == chunk.chunk_id
        assert p.token_ids[seg.start:seg.start + seg.length] == b.unit_ids(chunk)
    assert p.token_ids[p.ctx_len:] == b.tail_ids("Where does the parliament meet?")
    assert "parliament" in tokenizer.decode(p.token_ids[p.ctx_len:])


def test_a_chunk_has_the_same_key_and_tokens_at_any_position(tokenizer, chunks):
    b = builder(tokenizer)
    forward = b.build("q?", chunks)
    backward = b.build("q?", chunks[::-1])
    keys_f = {s.chunk_id: s.key for s in forward.segments[1:]}
    keys_b = {s.chunk_id: s.key for s in backward.segments[1:]}
    assert keys_f == keys_b and len(set(keys_f.values())) == len(chunks)
    assert forward.segments[1].start != backward.segments[3].start  # chunk 0 moved, same key


def test_placement_rule_puts_the_head_at_zero_and_every_chunk_right_after_it(tokenizer, chunks):
    b = builder(tokenizer, kv_context_tokens=0)
    assert lead_in_for(0, b.head_ids) == []
    assert lead_in_for(len(b.head_ids), b.head_ids) == b.head_ids
    assert lead_in_for(1234, b.head_ids) == b.head_ids
    seg = b.canonical_segment(chunks[1])
    assert (seg.key, seg.start, seg.length) == (b.key(chunks[1]), len(b.head_ids), len(b.unit_ids(chunks[1])))
    # the canonical place is where the chunk sits when it comes first
    first = b.build("q?", chunks[1:2]).segments[1]
    assert (first.start, first.key) == (seg.start, seg.key)
    assert is_canonical(first.start, b.head_ids) and is_canonical(0, b.head_ids)
    assert not is_canonical(first.start + 3, b.head_ids)


def test_with_a_kv_context_chunks_are_computed_after_the_head_and_the_context_and_none_is_exact(tokenizer, chunks):
    plain = builder(tokenizer, kv_context_tokens=0)
    b = builder(tokenizer, kv_context_tokens=64)
    text = KV_CONTEXT_FILE.read_text(encoding="utf-8")
    assert b.context_ids == tuple(encode(tokenizer, text)[:64]) and plain.context_ids == ()
    assert lead_in_for(0, b.head_ids, b.context_ids) == []
    assert lead_in_for(len(b.head_ids), b.head_ids, b.context_ids) == b.head_ids + list(b.context_ids)
    seg = b.canonical_segment(chunks[1])
    assert seg.start == len(b.head_ids) + 64 and seg.key == b.key(chunks[1])
    # the prompt itself is unchanged: the context is never in it, only in the chunks' keys
    p, q = b.build("q?", chunks), plain.build("q?", chunks)
    assert p.token_ids == q.token_ids and p.kv_context == b.context_ids and q.kv_context == ()
    assert [s.start for s in p.segments] == [s.start for s in q.segments]
    assert p.segments[0].key == q.segments[0].key  # the head has no lead-in either way
    assert all(x.key != y.key for x, y in zip(p.segments[1:], q.segments[1:]))
    # in a prompt a chunk follows the head and other chunks, never the context: nothing but the head is exact
    assert not any(is_canonical(s.start, b.head_ids, b.context_ids) for s in p.segments[1:])
    assert is_canonical(0, b.head_ids, b.context_ids)
    # the self-check's builder keys its chunk after the head alone
    assert b.without_kv_context().key(chunks[1]) == plain.key(chunks[1]) and b.context_ids
    with pytest.raises(ValueError, match="kv_context_tokens"):
        builder(tokenizer, kv_context_tokens=100_000)


def test_keys_change_with_the_model_and_the_system_prompt(tokenizer, chunks):
    base = builder(tokenizer)
    other_model = builder(tokenizer, fingerprint="fp1")
    other_system = builder(tokenizer, system_prompt="Answer in French.")
    for other in (other_model, other_system):
        assert other.key(chunks[0]) != base.key(chunks[0])
        assert other.head_key != base.head_key
    assert other_model.head_ids == base.head_ids and other_system.head_ids != base.head_ids


def test_empty_question_and_too_long_prompt_are_refused_with_the_fix(tokenizer, chunks):
    b = builder(tokenizer, max_len=64)
    for q in ("", "   "):
        with pytest.raises(ValueError, match="empty"):
            b.build(q, chunks)
    with pytest.raises(PromptTooLongError, match=r"max_model_len.*top_k"):
        b.build("Where?", chunks)
    assert b.build("Where?", chunks, max_len=4096).ctx_len > 0  # a per-call limit overrides


def test_history_goes_into_the_tail_and_leaves_head_and_chunk_units_unchanged(tokenizer, chunks):
    from ragcache.conversation import Turn
    from ragcache.prompt import format_history

    b = builder(tokenizer)
    history = [Turn("user", "What is the capital of Zorbia?"), Turn("assistant", "Velmora.")]
    alone = b.build("Who founded it?", chunks)
    follow_up = b.build("Who founded it?", chunks, history=history)
    # the reused KV is served for the same tokens at the same positions, under the same keys
    assert follow_up.segments == alone.segments and follow_up.ctx_len == alone.ctx_len
    assert follow_up.token_ids[:follow_up.ctx_len] == alone.token_ids[:alone.ctx_len]
    tail = tokenizer.decode(follow_up.token_ids[follow_up.ctx_len:])
    assert tail.index("Conversation so far:\nUser: What is the capital of Zorbia?\nAssistant: Velmora.") \
        < tail.index("Question: Who founded it?")
    assert format_history([]) == "" and format_history([Turn("system", "Be brief.")]).endswith(
        "Instructions: Be brief.\n\n")
    assert b.tail_ids("Who founded it?", ()) == b.tail_ids("Who founded it?")  # no history: the old tail
    with pytest.raises(PromptTooLongError, match="conversation"):
        builder(tokenizer, max_len=alone.ctx_len + 20).build("Who founded it?", chunks, history=history * 5)
