"""ragcache.engine.worker: on CPU vLLM's sampler counts logprob ranks eagerly, with vLLM's own expression."""

import pytest
import torch

from ragcache.engine.worker import eager_logprob_ranks, use_eager_logprob_ranks

sampler = pytest.importorskip("vllm.v1.sample.sampler")
vllm_logprobs = pytest.importorskip("vllm.v1.sample.ops.logprobs")


def test_eager_ranks_equal_vllms_expression_across_row_blocks_and_ties():
    g = torch.Generator().manual_seed(3)
    logprobs = torch.randn(7, 50, generator=g).log_softmax(-1)
    logprobs[2, :10] = logprobs[2].max() + 1  # ten tied at the top: ties count as >=
    values = logprobs.gather(-1, torch.randint(0, 50, (7, 1), generator=g))
    uncompiled = getattr(vllm_logprobs.batched_count_greater_than, "_torchdynamo_orig_callable",
                         vllm_logprobs.batched_count_greater_than)
    expected = uncompiled(logprobs, values)
    for rows in (1, 3, 7, 256):  # 7 rows in blocks that do and do not divide them
        got = eager_logprob_ranks(logprobs, values, rows=rows)
        assert got.dtype == torch.long and torch.equal(got, expected)
    assert eager_logprob_ranks(logprobs[2:3], logprobs[2:3, :1]).item() == 10


def test_only_the_cpu_sampler_is_switched_to_the_eager_count(monkeypatch):
    compiled = vllm_logprobs.batched_count_greater_than  # vLLM's own (an engine started earlier may have switched)
    monkeypatch.setattr(sampler, "batched_count_greater_than", compiled)  # restored after the test
    assert not use_eager_logprob_ranks(torch.device("meta"))
    assert sampler.batched_count_greater_than is compiled
    assert use_eager_logprob_ranks(torch.device("cpu"))
    assert sampler.batched_count_greater_than is eager_logprob_ranks
