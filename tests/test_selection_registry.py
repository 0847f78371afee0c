"""Selection strategies have one home: a strategy added here, in the test alone (one record in
ragcache.strategies, one score function in ragcache.blend.select), is accepted by the settings, a
request's options and the engine's messages, and runs a real blend on a tiny model; and the
settings import no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hf_ops import HFLlamaOps, LayerCollector, context_layout, tiny_context, tiny_llama
from pydantic import ValidationError

from ragcache import strategies
from blend_calls import blend_of

from ragcache.blend import SCORES, compute_kv, hkvd_budget, move_keys, score_function
from ragcache.config import BlendSettings, ConfigError, Settings
from ragcache.engine.messages import BlendParams
from ragcache.options import QueryOptions, SelectionSpec
from ragcache.strategies import COMMON_SETTINGS, Selection, Strategy
from tests.conftest import REPO

TOY = "first-tokens"


@pytest.fixture
def first_tokens():
    """A toy strategy: the first tokens of each request's context, whatever the question or the KV
    (it needs neither, so its check layer is 0)."""
    record = strategies.register(Strategy(TOY, check_layer=0))

    @score_function(TOY)
    def score(selection: Selection, scores) -> torch.Tensor:
        return 1.0 / (1.0 + scores.offsets.float())

    yield record
    del strategies.STRATEGIES[TOY], SCORES[TOY]


@pytest.fixture(scope="module")
def tiny():
    ops = HFLlamaOps(tiny_llama())
    return ops, tiny_context(ops)


def test_the_settings_and_the_engine_messages_import_no_torch():
    code = ("import sys, ragcache.config, ragcache.options, ragcache.strategies, ragcache.engine.messages; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_strategy_registered_in_a_test_runs_a_real_blend(first_tokens, tiny):
    ops, context = tiny
    starts, exact = context_layout(context)
    n = context.token_ids.shape[0]
    check_layer = BlendSettings(selection=TOY).resolved_check_layer
    got = LayerCollector(ops.num_layers)
    result = blend_of(ops, context.token_ids, context.positions, context.load_layer, recompute_ratio=0.2,
                      check_layer=check_layer, deviation="value", selection=Selection(TOY), segment_starts=starts,
                      exact=exact, on_layer=got)
    # the budget goes to the first tokens after the exact ones (the lead-in and the first chunk)
    first = int(exact.sum())
    assert check_layer == 0 and result.selected.tolist() == list(range(first, first + hkvd_budget(0.2, n)))
    assert "question_probe_s" not in result.stages  # it needs no question tail: none was given or probed
    # layer 0's KV moves exactly, so the chosen tokens' layer-1 KV is full prefill's; the others' is not
    k_pre, v = compute_kv(ops, context.token_ids, context.positions)
    full_k1 = move_keys(ops, 1, k_pre[1], context.positions)
    rows = result.selected
    torch.testing.assert_close(got.k[1][rows], full_k1[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.v[1][rows], v[1][rows], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got.v[1][first + len(rows):], v[1][first + len(rows):], atol=1e-3)
    # at ratio 1 every token is recomputed: full prefill in every layer
    whole = LayerCollector(ops.num_layers)
    blend_of(ops, context.token_ids, context.positions, context.load_layer, recompute_ratio=1.0,
             check_layer=check_layer, deviation="value", selection=Selection(TOY, granule=4), segment_starts=starts,
             exact=exact, on_layer=whole)
    for layer in range(ops.num_layers):
        torch.testing.assert_close(whole.v[layer], v[layer], atol=1e-5, rtol=1e-5)


def test_the_settings_requests_and_messages_accept_a_registered_strategy(first_tokens):
    blend = BlendSettings(selection=TOY)
    assert blend.resolved_check_layer == 0 and not blend.adapts()
    assert BlendSettings(selection=TOY, check_layer=0).resolved_check_layer == 0  # no deviation to measure
    # a calibration holds over the settings it reads: here only those every strategy reads
    assert blend.calibrated_settings() == {**{f"blend.{k}": getattr(blend, k) for k in COMMON_SETTINGS},
                                           "blend.check_layer": 0}
    assert blend.check_model_layers(30) == []
    assert Settings.load(blend={"selection": TOY}).blend.selection == TOY
    options = QueryOptions.parse({"mode": "blend", "selection": f"{TOY}/4"})
    assert options.selection == SelectionSpec(strategy=TOY, granule=4)
    params = BlendParams.from_options(BlendSettings(), options, mode="blend", ctx_len=10, lead_in_len=1, segments=())
    knobs = params.blend
    assert knobs.token_selection == Selection.from_settings(BlendSettings(), TOY, 4) and knobs.check_layer == 0
    assert not knobs.token_selection.needs_question and not knobs.token_selection.needs_deviation
    assert BlendParams.from_dict(params.to_dict()) == params
    # an unknown name is refused with the registered names, the new one among them
    with pytest.raises(ConfigError, match="Input should be 'deviation', 'question', 'hybrid' or 'first-tokens'"):
        Settings.load(blend={"selection": "attention"})


def test_an_unregistered_name_is_refused_everywhere():
    assert TOY not in strategies.names()
    with pytest.raises(ValidationError, match="Input should be 'deviation', 'question' or 'hybrid'"):
        BlendSettings(selection=TOY)
    with pytest.raises(ValueError, match="selection must be one of"):
        Selection(TOY)
    with pytest.raises(ValueError, match="selection must be one of"):
        BlendSettings().check_layer_for(TOY)


def test_registration_refuses_a_taken_name_or_a_slash_and_a_record_needs_its_score_function():
    with pytest.raises(ValueError, match="registered already"):
        strategies.register(Strategy("question"))
    with pytest.raises(ValueError, match="without '/'"):
        strategies.register(Strategy("first/tokens"))
    with pytest.raises(ValueError, match="has a score function already"):
        score_function("hybrid")(lambda selection, scores: scores.question)
    strategies.register(Strategy("unscored", check_layer=0))
    try:
        from ragcache.blend import select_tokens

        with pytest.raises(ValueError, match="has no score function"):
            select_tokens(2, Selection("unscored"), exact=torch.zeros(5, dtype=torch.bool))
    finally:
        del strategies.STRATEGIES["unscored"]
