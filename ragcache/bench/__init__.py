"""Benchmarks and answer-quality evaluation: what ``ragcache bench`` and ``ragcache eval`` measure.

Owns, one job per module:

- ``metrics``: answer-quality metrics (SQuAD-normalised token F1, exact match, Rouge-L, KL
  divergence between two first-token distributions, teacher-forced gold-answer NLL) and the
  statistics every summary uses (median, percentile, mean);
- ``datasets``: the MuSiQue / HotpotQA loader and passages as chunks;
- ``environment``: settings for a benchmark, the machine and engine description, the result stamp;
- ``common``: what several runners share (variants as data, rotated order, warm-ups, the
  per-request record, targets);
- one module per runner, each returning a plain JSON-able dict: ``ttft`` (with its
  recompute-ratio sweep, and the quality-only ``eval``), ``hotset``, ``throughput``, ``tiers``,
  ``storage`` (stored forms of chunk KV: bytes, codec rates, TTFT per tier, quality),
  ``ingest``, ``serve``, ``scale``;
- ``report``: text/markdown tables, plots, and the RESULT.json/.md/.png files;
- ``bandwidth`` (a KV entry's read bandwidth per tier), ``retrieval`` (search latency),
  ``coldstart`` (start-up and the first request), and ``plain``'s ``run_plain`` (a plain vLLM
  prefill in any dtype): the measurements that were scripts before, now ``ragcache bench`` kinds;
- ``diverge``: where blend's greedy answers part from full prefill's and why (attended tokens, their
  KV error, counterfactual reruns), on ``reference`` (the model through transformers as
  ``DecoderOps`` and a plain-torch decode that returns attention), the one module here that imports
  torch and transformers at import: only the ``diverge`` runner imports it;

The services a runner starts (a throwaway redis-server, Redis Cluster, PostgreSQL, HAProxy, server
replicas) and the page-cache drop live outside the SDK, in :mod:`ragcache_testing.services`, which
tests/ share. The CLI (app/bench_cmd.py) only parses flags. Nothing here imports app/ or ui/. ``import
ragcache.bench`` (and each module at import) stays light: no vLLM, no torch, no matplotlib.
Runners work on the :class:`~ragcache.engine.BlendEngine` they are handed through its public
methods; vLLM is imported only inside runners (``tiers`` starts its own engines in child
processes), llama-index only inside ``hotset``'s runner, matplotlib only inside ``report.plot``.

Measurement rules, because these machines are shared and noisy:

- every example is asked in every mode, back to back, in an order rotated by one per example, so
  drifting machine load hits all modes alike; the reported speedup is the median of per-example
  ratios ``ttft(full) / ttft(mode)``, not a ratio of means;
- greedy decoding throughout; first-token distributions over the whole vocabulary (``logprobs=-1``);
- vLLM's prefix cache is reset before each example; ``full``, ``reuse`` and ``blend`` requests carry a
  unique cache salt (see BlendEngine), so only ``prefix`` requests share exact-prefix blocks;
- quality requests (gold-answer NLL) run after all timed requests of an example, so they never warm
  a cache a timed request could hit;
- one untimed request per mode runs before the first timed one (the first request after start-up
  pays seconds of one-time costs on CPU).
"""
