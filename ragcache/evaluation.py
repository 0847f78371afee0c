"""Evaluation: answer-quality metrics and the benchmark runners behind ``ragcache bench`` / ``ragcache eval``.

Owns: the metrics (SQuAD-normalised token F1, exact match, Rouge-L, KL divergence between two
first-token distributions, teacher-forced gold-answer NLL), the QA-set loader, and one runner per
benchmark (``ttft`` with its recompute-ratio sweep, ``hotset``, ``throughput``, ``tiers``,
``ingest``, and the quality-only ``eval``). Every runner returns a plain JSON-able dict; the tables
and plots that present them live here too, so the CLI (app/bench_cmd.py) only parses flags.

Imports ragcache.chunks/config/prompt at module level, ragcache.retrieval (llama-index) and the
engine (vLLM) only inside the runners; never app/ or ui/.

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

from __future__ import annotations

import json
import math
import os
import platform
import random
import re
import shutil
import string
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from ragcache.chunks import Chunk, chunk_id_for
from ragcache.config import MODES, Settings
from ragcache.prompt import AssembledPrompt

if TYPE_CHECKING:
    from ragcache.engine import BlendEngine, Generation

Progress = Callable[[str], None]
Checkpoint = Callable[[dict[str, Any]], None]

#: MuSiQue / HotpotQA files under the shared data folder, by short name
DATASETS = {
    "musique": "musique/musique_s.json",
    "hotpotqa": "hotpotqa/hotpotqa_distractor_100.json",
}

#: question of the untimed warm-up requests that fill vLLM's prefix cache for ``prefix`` mode
WARMUP_QUESTION = "What are these documents about?"

#: KL(full || mode) of the ``reuse`` mode is the yardstick of the blend quality target
TARGETS = {
    "blend_ttft_speedup_min": 4.0,      # blend (default ratio) TTFT >= 4x lower than full, MuSiQue
    "blend_kl_vs_reuse_max": 0.5,       # blend first-token KL <= half of reuse's
    "blend_nll_rel_max": 0.02,          # blend gold NLL within 2% of full's
    "hotset_last_vs_first_min": 0.9,    # speedup of the last 10 questions >= 90% of the first 10
    "disk_vs_cpu_ttft_max": 1.2,        # disk-tier blend TTFT <= 1.2x cpu-tier, pipeline_overlap on
}


# =================================================================================================
# Metrics
# =================================================================================================

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD answer normalisation: lower case, drop punctuation and the articles a/an/the, squeeze spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _tokens(text: str) -> list[str]:
    return normalize_answer(text).split()


def _golds(golds: str | Iterable[str]) -> list[str]:
    return [golds] if isinstance(golds, str) else list(golds)


def exact_match(prediction: str, golds: str | Iterable[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return max((float(pred == normalize_answer(g)) for g in _golds(golds)), default=0.0)


def token_f1(prediction: str, golds: str | Iterable[str]) -> float:
    """SQuAD token F1 in [0, 1] on normalised tokens, the maximum over the gold answers.

    F1 = 2PR / (P + R) over the multiset of shared tokens; an empty prediction or gold scores 1.0
    only against an empty counterpart.
    """
    pred = _tokens(prediction)
    best = 0.0
    for gold in _golds(golds):
        ref = _tokens(gold)
        if not pred or not ref:
            score = float(pred == ref)
        else:
            same = sum((Counter(pred) & Counter(ref)).values())
            score = 0.0 if same == 0 else 2 * same / (len(pred) + len(ref))  # = 2PR/(P+R)
        best = max(best, score)
    return best


def lcs_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (O(len(a) * len(b)))."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, golds: str | Iterable[str]) -> float:
    """Rouge-L F-measure (beta = 1) in [0, 1] on normalised tokens, the maximum over the gold answers.

    P = LCS / len(prediction), R = LCS / len(gold), F = 2PR / (P + R).
    """
    pred = _tokens(prediction)
    best = 0.0
    for gold in _golds(golds):
        ref = _tokens(gold)
        if not pred or not ref:
            score = float(pred == ref)
        else:
            lcs = lcs_length(pred, ref)
            score = 0.0 if lcs == 0 else 2 * lcs / (len(pred) + len(ref))  # = 2PR/(P+R)
        best = max(best, score)
    return best


def kl_divergence(p: Mapping[int, float], q: Mapping[int, float]) -> float:
    """KL(p || q) in nats from two ``{token_id: logprob}`` distributions over the whole vocabulary.

    ``sum_t exp(p_t) * (p_t - q_t)``. Use p = full prefill, q = the mode under test. A token missing
    from ``q`` (only possible with a truncated distribution) counts as q's least likely token;
    tokens with p = 0 contribute nothing. Rounding noise below zero is clipped to 0.
    """
    if not p:
        raise ValueError("p is empty: request the first token's logprobs with logprobs=-1")
    floor = min(q.values()) if q else -math.inf
    total = 0.0
    for tok, lp in p.items():
        if lp == -math.inf:
            continue
        total += math.exp(lp) * (lp - q.get(tok, floor))
    return max(total, 0.0)


def mean_nll(logprobs: Sequence[float]) -> float:
    """Mean negative log-likelihood per token, in nats, of teacher-forced token log-probabilities."""
    if not logprobs:
        raise ValueError("no token log-probabilities to average")
    return -sum(logprobs) / len(logprobs)


def median(values: Sequence[float]) -> float | None:
    """Median (mean of the two middle values for an even count); None for no values."""
    return percentile(values, 50.0)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


# =================================================================================================
# Data
# =================================================================================================


class DatasetNotFoundError(FileNotFoundError):
    """The QA file does not exist (the shared data lives in ../shared/data beside the repository)."""


class BenchConfigError(ValueError):
    """A benchmark parameter is invalid (unknown mode, ratio outside [0, 1], too few examples...)."""


@dataclass
class QAExample:
    """One multi-passage QA example.

    Attributes:
        index: position in the file.
        question: the question.
        answers: gold answers (the first is the canonical one; the rest are aliases).
        passages: ``(title, text)`` in the file's (retrieval) order.
    """

    index: int
    question: str
    answers: list[str]
    passages: list[tuple[str, str]]


def shared_data_dir() -> Path:
    """``$RAGCACHE_DATA_DIR``, else ``../shared/data`` beside the repository (or the working directory)."""
    env = os.environ.get("RAGCACHE_DATA_DIR")
    if env:
        return Path(env)
    for base in (Path(__file__).resolve().parents[1], Path.cwd()):
        cand = base.parent / "shared" / "data"
        if cand.is_dir():
            return cand
    return Path(__file__).resolve().parents[1].parent / "shared" / "data"


def resolve_dataset(name_or_path: str | os.PathLike[str]) -> Path:
    """A dataset short name (``musique``, ``hotpotqa``) or a path, as an existing file.

    Raises:
        DatasetNotFoundError: no such file.
    """
    key = str(name_or_path)
    path = shared_data_dir() / DATASETS[key] if key in DATASETS else Path(key).expanduser()
    if not path.is_file():
        raise DatasetNotFoundError(
            f"dataset {path} not found: pass --dataset musique|hotpotqa (files under ../shared/data, "
            f"or set RAGCACHE_DATA_DIR) or a JSON file of {{question, answers, ctxs:[{{title, text}}]}}")
    return path


def load_qa(path: str | os.PathLike[str], n: int | None = None, offset: int = 0) -> list[QAExample]:
    """Read ``n`` examples from ``offset`` of a QA file: a JSON list of ``{question, answers, ctxs}``."""
    data = json.loads(resolve_dataset(path).read_text(encoding="utf-8"))
    stop = len(data) if n is None else min(len(data), offset + n)
    out = []
    for i in range(offset, stop):
        ex = data[i]
        out.append(QAExample(
            index=i, question=ex["question"], answers=list(ex.get("answers") or []),
            passages=[(c.get("title") or "", c["text"]) for c in ex["ctxs"]],
        ))
    return out


def passage_text(title: str, text: str) -> str:
    """A passage as chunk text: ``title\\ntext`` (just ``text`` when untitled, as in MuSiQue)."""
    return f"{title}\n{text}" if title else text


def make_chunks(tokenizer: Any, passages: Sequence[tuple[str, str]], source: str = "qa") -> list[Chunk]:
    """One :class:`Chunk` per ``(title, text)`` passage, token ids fixed with ``tokenizer`` (no BOS)."""
    chunks = []
    for title, body in passages:
        text = passage_text(title, body)
        cid = chunk_id_for(text)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        chunks.append(Chunk(cid, f"{source}:{cid}", title, 0, text, tuple(ids)))
    return chunks


def _distinct(chunks: Iterable[Chunk]) -> list[Chunk]:
    seen: dict[str, Chunk] = {}
    for c in chunks:
        seen.setdefault(c.chunk_id, c)
    return list(seen.values())


# =================================================================================================
# Environment: settings for benchmarks, machine description
# =================================================================================================


def bench_settings(settings_file: str | os.PathLike[str] | None = None, *, kv_dir: str | os.PathLike[str],
                   store: Mapping[str, Any] | None = None, engine: Mapping[str, Any] | None = None,
                   blend: Mapping[str, Any] | None = None) -> Settings:
    """Settings for a benchmark: the user's settings with the KV store in ``kv_dir`` and no Redis.

    The chunk KV of a benchmark (gigabytes for MuSiQue) never lands in the user's cache folder,
    and a configured shared Redis is left alone; ``store`` overrides win over both.
    """
    st = {"ssd_cache_dir": str(kv_dir), "remote_url": ""}
    st.update(store or {})
    overrides: dict[str, Any] = {"store": st}
    if engine:
        overrides["engine"] = dict(engine)
    if blend:
        overrides["blend"] = dict(blend)
    return Settings.load(settings_file, **overrides)


def machine_info() -> dict[str, Any]:
    """CPU, memory, library versions and the load average: the context every result needs."""
    info: dict[str, Any] = {
        "platform": platform.platform(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_gb"] = round(int(line.split()[1]) / 1e6, 1)
                break
    except OSError:
        pass
    try:
        info["load_avg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    for mod in ("torch", "vllm", "transformers"):
        try:
            info[f"{mod}_version"] = __import__(mod).__version__
        except Exception:  # pragma: no cover - reporting only
            pass
    return info


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _engine_info(engine: "BlendEngine") -> dict[str, Any]:
    s = engine.settings
    return {
        "model": s.models.model, "device": getattr(engine, "device", None),
        "startup_s": round(float(getattr(engine, "startup_s", 0.0)), 2),
        "dtype": s.engine.dtype, "in_process": s.engine.in_process,
        "recompute_ratio": s.blend.recompute_ratio, "check_layer": s.blend.check_layer,
        "deviation": s.blend.deviation, "pipeline_overlap": s.blend.pipeline_overlap,
        "store": {"cpu_kv_pool_gb": s.store.cpu_kv_pool_gb, "ssd_cache_max_gb": s.store.ssd_cache_max_gb,
                  "remote": bool(s.store.remote_url), "kv_dtype": s.store.kv_dtype},
    }


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


# =================================================================================================
# Requests: modes, prefix warm-up, teacher-forced scoring
# =================================================================================================


@dataclass(frozen=True)
class Variant:
    """A way of answering: a mode, and for ``blend`` its recompute ratio. ``name`` keys the results."""

    name: str
    mode: str
    ratio: float | None = None


def ratio_name(ratio: float) -> str:
    return f"blend@{ratio:g}"


def make_variants(modes: Sequence[str], ratios: Sequence[float], default_ratio: float) -> list[Variant]:
    """``full`` first (the reference of every comparison), then the modes; ``blend`` expands to one
    variant per ratio in ``ratios`` plus ``default_ratio``.

    Raises:
        BenchConfigError: an unknown mode or a ratio outside [0, 1].
    """
    for m in modes:
        if m not in MODES:
            raise BenchConfigError(f"unknown mode {m!r}; use some of {', '.join(MODES)}")
    for r in [*ratios, default_ratio]:
        if not 0.0 <= r <= 1.0:
            raise BenchConfigError(f"recompute ratio {r} is outside [0, 1]")
    out = [Variant("full", "full")]
    for m in dict.fromkeys(modes):
        if m == "full":
            continue
        if m == "blend":
            out += [Variant(ratio_name(r), "blend", r) for r in sorted(set(ratios) | {default_ratio})]
        else:
            out.append(Variant(m, m))
    return out


def rotated(items: Sequence[Any], k: int) -> list[Any]:
    """``items`` rotated left by ``k`` (mod length): example k asks the modes in this order."""
    if not items:
        return []
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def warm_prefix_cache(engine: "BlendEngine", chunks: Sequence[Chunk], how: str) -> None:
    """Fill vLLM's prefix cache before a timed ``prefix`` request (the warm-up itself is not timed).

    ``chunks``: each chunk once on its own right after the prompt head (what ingest gives blend),
        so only the head and the prompt's first chunk can be exact-prefix hits;
    ``context``: the same chunks in the same order with another question (the best case for
        prefix caching: a repeated chunk set);
    ``none``: nothing (``prefix`` then costs a full prefill).
    """
    if how == "none":
        return
    if how == "chunks":
        prompts = [engine.prompts.build(WARMUP_QUESTION, [c]) for c in chunks]
    elif how == "context":
        prompts = [engine.prompts.build(WARMUP_QUESTION, list(chunks))]
    else:
        raise ValueError(f"unknown prefix warm-up {how!r}; use chunks, context or none")
    engine.generate_many(prompts, "prefix", max_tokens=1)


def generate_with_distribution(engine: "BlendEngine", prompt: AssembledPrompt, mode: str, *,
                               recompute_ratio: float | None = None, max_tokens: int = 32) -> "Generation":
    """Greedy answer, metrics and the first-token distribution over the whole vocabulary."""
    return engine.generate(prompt, mode, recompute_ratio=recompute_ratio, max_tokens=max_tokens, logprobs=-1)


def continuation_logprobs(engine: "BlendEngine", prompt: AssembledPrompt, continuation: Sequence[int],
                          mode: str, recompute_ratio: float | None = None) -> list[float]:
    """Teacher-forced log-probabilities (nats) of ``continuation`` right after ``prompt`` (see
    :meth:`ragcache.engine.BlendEngine.continuation_logprobs`)."""
    return engine.continuation_logprobs(prompt, continuation, mode, recompute_ratio=recompute_ratio)


def warm_up(engine: "BlendEngine", chunks: Sequence[Chunk], modes: Sequence[str] = ("full", "blend")) -> None:
    """One untimed short request per mode: the first request after start-up pays one-time costs
    (kernel set-up, allocations; seconds on CPU) that would otherwise land in one timed TTFT."""
    prompt = engine.prompts.build(WARMUP_QUESTION, list(chunks)[:2])
    for mode in dict.fromkeys(modes):
        engine.generate(prompt, mode, max_tokens=2)
    engine.reset_prefix_cache()


def answer_ids(engine: "BlendEngine", answer: str) -> list[int]:
    """Token ids of a gold answer as the assistant would write it (no BOS, no end-of-turn)."""
    return list(engine.tokenizer(answer.strip(), add_special_tokens=False)["input_ids"])


def _record(g: "Generation") -> dict[str, Any]:
    m = g.metrics
    return {
        "ttft_s": _r(m.ttft_s), "total_s": _r(m.total_s), "load_s": _r(m.load_s), "worker_s": _r(m.worker_s),
        "prompt_tokens": m.prompt_tokens, "ctx_tokens": m.ctx_tokens, "reused_tokens": m.reused_tokens,
        "recomputed_tokens": m.recomputed_tokens, "missing_computed_tokens": m.missing_computed_tokens,
        "num_cached_tokens": m.num_cached_tokens, "output_tokens": m.output_tokens,
        "chunk_tiers": list(m.chunk_tiers), "answer": g.text,
    }


# =================================================================================================
# bench ttft (and eval): every mode side by side, with the recompute-ratio sweep
# =================================================================================================


def run_ttft(engine: "BlendEngine", examples: Sequence[QAExample], *, modes: Sequence[str] = MODES,
             ratios: Sequence[float] = (0.0, 0.05, 0.1, 0.15, 0.3, 1.0), default_ratio: float | None = None,
             passages: int = 10, max_tokens: int = 32, prefix_warmup: str = "chunks", nll: bool = True,
             progress: Progress | None = None, checkpoint: Checkpoint | None = None) -> dict[str, Any]:
    """TTFT and quality of every mode on the same prompts, asked in a rotated order per example.

    Per example: chunks from its first ``passages`` passages (file order), KV precomputed once
    (before the first example, :func:`warm_up`); vLLM's prefix cache reset; then one timed greedy
    request per variant (``max_tokens`` decoded, first-token distribution over the whole
    vocabulary); ``prefix`` is preceded by an untimed warm-up (see :func:`warm_prefix_cache`).
    After the timed requests, the gold answer's mean NLL is scored per variant with
    :func:`continuation_logprobs` (``full`` and ``prefix`` both serve exact KV, so one exact score,
    taken in ``prefix`` mode over the warm cache, stands for both).

    Returns a dict with ``modes`` (summary of full/prefix/reuse/blend at ``default_ratio``),
    ``sweep`` (one summary per blend ratio), ``variants`` (every variant's summary), ``targets`` and
    ``examples`` (per-example records of every variant). ``checkpoint``, when given, receives the
    result so far (``"partial": True``) after every example, so an interrupted run keeps its data.
    """
    say = progress or (lambda _msg: None)
    default_ratio = engine.settings.blend.recompute_ratio if default_ratio is None else default_ratio
    variants = make_variants(modes, ratios, default_ratio)
    records: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for i, ex in enumerate(examples):
        t_ex = time.perf_counter()
        chunks = make_chunks(engine.tokenizer, ex.passages[:passages])
        pre = engine.precompute(chunks)
        prompt = engine.prompts.build(ex.question, chunks)
        if i == 0:
            warm_up(engine, chunks, [v.mode for v in variants])
        engine.reset_prefix_cache()
        gens: dict[str, Generation] = {}
        order = rotated(variants, i)
        for v in order:
            if v.mode == "prefix":
                warm_prefix_cache(engine, chunks, prefix_warmup)
            gens[v.name] = generate_with_distribution(engine, prompt, v.mode, recompute_ratio=v.ratio,
                                                      max_tokens=max_tokens)
        gold_ids = answer_ids(engine, ex.answers[0]) if (nll and ex.answers) else []
        nlls: dict[str, float | None] = {}
        exact_nll: float | None = None
        for v in variants:
            if not gold_ids:
                nlls[v.name] = None
            elif v.mode in ("full", "prefix"):
                if exact_nll is None:
                    exact_nll = mean_nll(continuation_logprobs(engine, prompt, gold_ids, "prefix"))
                nlls[v.name] = exact_nll
            else:
                nlls[v.name] = mean_nll(continuation_logprobs(engine, prompt, gold_ids, v.mode, v.ratio))
        full = gens["full"]
        p_full = full.first_token_logprobs or {}
        results = {}
        for v in variants:
            g = gens[v.name]
            rec = _record(g)
            q = g.first_token_logprobs or {}
            rec.update(
                recompute_ratio=v.ratio,
                first_token=g.token_ids[0] if g.token_ids else None,
                kl_from_full=_r(kl_divergence(p_full, q), 6) if (p_full and q) else None,
                gold_nll=_r(nlls[v.name]),
                f1=_r(token_f1(g.text, ex.answers)), rouge_l=_r(rouge_l(g.text, ex.answers)),
                em=exact_match(g.text, ex.answers),
                agree_em=exact_match(g.text, full.text), agree_rouge_l=_r(rouge_l(g.text, full.text)),
                agree_tokens=float(g.token_ids == full.token_ids),
                speedup=_r(full.metrics.ttft_s / g.metrics.ttft_s) if g.metrics.ttft_s > 0 else None,
            )
            results[v.name] = rec
        records.append({
            "index": ex.index, "question": ex.question, "answers": ex.answers,
            "passages": len(chunks), "prompt_tokens": len(prompt.token_ids), "ctx_tokens": prompt.ctx_len,
            "gold_answer_tokens": len(gold_ids), "precompute": pre, "order": [v.name for v in order],
            "results": results,
        })
        brief = "  ".join(f"{v.name} {results[v.name]['ttft_s']:.2f}s" for v in variants)
        say(f"[{i + 1}/{len(examples)}] example {ex.index}: {len(prompt.token_ids)} tokens | {brief} "
            f"| {time.perf_counter() - t_ex:.0f} s")
        if checkpoint is not None and i + 1 < len(examples):
            checkpoint({**_ttft_result(variants, records, default_ratio, passages, max_tokens, prefix_warmup,
                                       time.perf_counter() - t_start), "partial": True})
    return _ttft_result(variants, records, default_ratio, passages, max_tokens, prefix_warmup,
                        time.perf_counter() - t_start)


def _ttft_result(variants: Sequence[Variant], records: list[dict[str, Any]], default_ratio: float, passages: int,
                 max_tokens: int, prefix_warmup: str, run_s: float) -> dict[str, Any]:
    summaries = {v.name: summarize_variant(v, records) for v in variants}
    main = {"full": summaries["full"]}
    for m in ("prefix", "reuse"):
        if m in summaries:
            main[m] = summaries[m]
    if ratio_name(default_ratio) in summaries:
        main["blend"] = summaries[ratio_name(default_ratio)]
    sweep = [summaries[v.name] for v in variants if v.mode == "blend"]
    return {
        "benchmark": "ttft", "n": len(records), "passages": passages, "max_tokens": max_tokens,
        "prefix_warmup": prefix_warmup, "default_ratio": default_ratio,
        "ratios": sorted({v.ratio for v in variants if v.ratio is not None}),
        "modes": main, "sweep": sweep, "variants": summaries, "targets": ttft_targets(main),
        "run_s": round(run_s, 1), "examples": records,
    }


def summarize_variant(v: Variant, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians, p90 and means of one variant over the examples (seconds, nats, fractions)."""
    rs = [r["results"][v.name] for r in records]
    fulls = [r["results"]["full"] for r in records]
    ttft = [x["ttft_s"] for x in rs]
    nll = mean(x["gold_nll"] for x in rs)
    nll_full = mean(x["gold_nll"] for x in fulls)
    return {
        "variant": v.name, "mode": v.mode, "recompute_ratio": v.ratio, "n": len(rs),
        "ttft_median_s": _r(median(ttft)), "ttft_p90_s": _r(percentile(ttft, 90)), "ttft_mean_s": _r(mean(ttft)),
        "speedup_median": _r(median([x["speedup"] for x in rs]), 3),
        "load_s_median": _r(median([x["load_s"] for x in rs])), "worker_s_median": _r(median([x["worker_s"] for x in rs])),
        "kl_mean": _r(mean(x["kl_from_full"] for x in rs), 5), "kl_median": _r(median([x["kl_from_full"] for x in rs]), 5),
        "gold_nll_mean": _r(nll), "gold_nll_rel_full": _r(nll / nll_full - 1.0) if (nll and nll_full) else None,
        "f1_mean": _r(mean(x["f1"] for x in rs)), "rouge_l_mean": _r(mean(x["rouge_l"] for x in rs)),
        "em_mean": _r(mean(x["em"] for x in rs)),
        "agree_em_mean": _r(mean(x["agree_em"] for x in rs)),
        "agree_rouge_l_mean": _r(mean(x["agree_rouge_l"] for x in rs)),
        "agree_tokens_mean": _r(mean(x["agree_tokens"] for x in rs)),
        "recomputed_frac_mean": _r(mean(x["recomputed_tokens"] / x["ctx_tokens"] if x["ctx_tokens"] else 0.0
                                        for x in rs)),
        "prompt_tokens_mean": _r(mean(x["prompt_tokens"] for x in rs), 1),
    }


def _target(value: float | None, limit: float, kind: str, note: str) -> dict[str, Any]:
    """A target record: ``kind`` is ``min`` (value >= limit), ``max`` (value <= limit) or
    ``max_abs`` (|value| <= limit); ``met`` is None when the value could not be measured."""
    checks = {"min": lambda v: v >= limit, "max": lambda v: v <= limit, "max_abs": lambda v: abs(v) <= limit}
    return {"value": _r(value, 4), kind: limit, "met": None if value is None else checks[kind](value), "note": note}


def ttft_targets(main: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The issue's targets that a ttft run measures (met is None where a mode was not run)."""
    blend, reuse = main.get("blend"), main.get("reuse")
    out: dict[str, Any] = {}
    if blend:
        out["blend_ttft_speedup"] = _target(blend["speedup_median"], TARGETS["blend_ttft_speedup_min"], "min",
                                            "median per-example TTFT(full)/TTFT(blend)")
        out["blend_nll_within"] = _target(blend["gold_nll_rel_full"], TARGETS["blend_nll_rel_max"], "max_abs",
                                          "mean gold NLL(blend) / mean gold NLL(full) - 1 (below 0: blend finds "
                                          "the gold answer likelier)")
        if reuse and blend["kl_mean"] is not None and reuse["kl_mean"]:
            out["blend_kl_vs_reuse"] = _target(blend["kl_mean"] / reuse["kl_mean"], TARGETS["blend_kl_vs_reuse_max"],
                                               "max", "mean KL(full||blend) / mean KL(full||reuse)")
    return out


def run_eval(engine: "BlendEngine", examples: Sequence[QAExample], *, mode: str, recompute_ratio: float | None = None,
             passages: int = 10, max_tokens: int = 32, progress: Progress | None = None) -> dict[str, Any]:
    """Quality only: KL(full || mode) of the first token, gold-answer NLL, F1, Rouge-L, EM, agreement.

    ``full`` is always run as the reference. No prefix warm-up (``prefix`` serves exact KV; its
    quality equals full's, only its speed depends on the cache).
    """
    ratio = engine.settings.blend.recompute_ratio if recompute_ratio is None else recompute_ratio
    res = run_ttft(engine, examples, modes=[mode], ratios=[], default_ratio=ratio, passages=passages,
                   max_tokens=max_tokens, prefix_warmup="none", progress=progress)
    name = ratio_name(ratio) if mode == "blend" else mode
    keys = ("n", "kl_mean", "kl_median", "gold_nll_mean", "gold_nll_rel_full", "f1_mean", "rouge_l_mean", "em_mean",
            "agree_em_mean", "agree_rouge_l_mean", "agree_tokens_mean", "recomputed_frac_mean")
    pick = lambda s: {k: s[k] for k in keys}  # noqa: E731
    examples_out = [{
        "index": r["index"], "question": r["question"], "answers": r["answers"],
        "answer": r["results"][name]["answer"], "full_answer": r["results"]["full"]["answer"],
        **{k: r["results"][name][k] for k in ("kl_from_full", "gold_nll", "f1", "rouge_l", "em", "agree_em",
                                                "agree_rouge_l", "agree_tokens")},
        "full_gold_nll": r["results"]["full"]["gold_nll"],
    } for r in res["examples"]]
    return {
        "benchmark": "eval", "mode": mode, "recompute_ratio": ratio if mode == "blend" else None,
        "n": res["n"], "passages": passages, "max_tokens": max_tokens,
        "quality": pick(res["variants"][name]), "full": pick(res["variants"]["full"]),
        "run_s": res["run_s"], "examples": examples_out,
    }


# =================================================================================================
# bench hotset: steady-state traffic over a hot set of chunks
# =================================================================================================


@dataclass
class HotQuestion:
    """A hotset question: its own passages plus ``hot`` passages drawn from the shared hot pool."""

    index: int
    question: str
    answers: list[str]
    passages: list[tuple[str, str]]
    hot: int


def build_hotset(examples: Sequence[QAExample], *, questions: int = 50, passages: int = 6, overlap: float = 0.7,
                 hot_pool: int = 12, seed: int = 0) -> list[HotQuestion]:
    """Questions whose chunk sets overlap about ``overlap`` with what earlier questions used.

    The hot pool is the ``hot_pool`` passages that recur most often across ``examples`` (MuSiQue
    passages repeat, which is what KV reuse feeds on). Question i is example i's question over
    ``round(overlap * passages)`` passages drawn (seeded) from the hot pool plus its own first
    passages outside the pool, ``passages`` in all.

    Raises:
        BenchConfigError: too few examples or passages for the request.
    """
    if not 0.0 <= overlap <= 1.0 or passages < 1:
        raise BenchConfigError(f"overlap must be in [0, 1] and passages >= 1; got {overlap}, {passages}")
    n_hot = round(overlap * passages)
    if n_hot > hot_pool:
        raise BenchConfigError(f"{n_hot} hot passages per question need a hot pool of at least {n_hot}")
    counts: Counter[str] = Counter()
    first: dict[str, tuple[str, str]] = {}
    for ex in examples:
        for title, text in ex.passages:
            counts[text] += 1
            first.setdefault(text, (title, text))
    pool = [first[t] for t, _ in counts.most_common(hot_pool)]
    pool_texts = {t for _, t in pool}
    if len(pool) < hot_pool:
        raise BenchConfigError(f"only {len(pool)} distinct passages for a hot pool of {hot_pool}")
    rng = random.Random(seed)
    out = []
    for ex in examples:
        if len(out) == questions:
            break
        own = [p for p in ex.passages if p[1] not in pool_texts][: passages - n_hot]
        if len(own) < passages - n_hot:
            continue
        out.append(HotQuestion(ex.index, ex.question, ex.answers, own + rng.sample(pool, n_hot), n_hot))
    if len(out) < questions:
        raise BenchConfigError(f"only {len(out)} questions could be built; use fewer or a larger dataset")
    return out


def _tier_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for name, a in after.items():
        b = before.get(name, {})
        hits = a["hits"] - b.get("hits", 0)
        misses = a["misses"] - b.get("misses", 0)
        out[name] = {"hits": hits, "misses": misses, "hit_rate": _r(hits / (hits + misses)) if hits + misses else None,
                     "entries": a["entries"], "occupancy_bytes": a["occupancy_bytes"],
                     "capacity_bytes": a["capacity_bytes"]}
    return out


def run_hotset(engine: "BlendEngine", questions: Sequence[HotQuestion], *, modes: Sequence[str] = ("full", "prefix",
               "blend"), max_tokens: int = 8, window: int = 10, progress: Progress | None = None,
               checkpoint: Checkpoint | None = None) -> dict[str, Any]:
    """The hotset sequence: ingest every chunk, then ask each question in every mode (rotated order).

    Chunks are put in the stable order retrieval uses. ``prefix`` gets no warm-up: it hits whatever
    exact prefixes earlier ``prefix`` requests left (the realistic case). Reports TTFT per question
    and mode, per-tier hit rates of the store over the sequence (lookups that reached each tier),
    the tiers that served blend's chunks, and the median speedup of the last ``window`` questions
    against the first ``window``. ``checkpoint`` gets the result so far after every question.
    """
    from ragcache.retrieval import stable_order

    say = progress or (lambda _msg: None)
    variants = make_variants(modes, [], engine.settings.blend.recompute_ratio)
    sets = [stable_order(make_chunks(engine.tokenizer, q.passages, source="musique")) for q in questions]
    t0 = time.perf_counter()
    pre = engine.precompute(_distinct(c for s in sets for c in s))
    ingest_s = time.perf_counter() - t0
    say(f"ingest: {pre['computed']} chunk KV computed, {pre['skipped']} already stored, {ingest_s:.1f} s")
    warm_up(engine, sets[0], [v.mode for v in variants])
    before = engine.store_stats()
    seen: set[str] = set()
    prev: set[str] = set()
    records = []
    served: Counter[str] = Counter()
    for i, (q, chunks) in enumerate(zip(questions, sets)):
        ids = {c.chunk_id for c in chunks}
        prompt = engine.prompts.build(q.question, chunks)
        row: dict[str, Any] = {"index": q.index, "prompt_tokens": len(prompt.token_ids),
                               "seen_before": _r(len(ids & seen) / len(ids)) if i else None,
                               "jaccard_prev": _r(len(ids & prev) / len(ids | prev)) if i else None,
                               "order": [], "results": {}}
        gens = {}
        for v in rotated(variants, i):
            gens[v.name] = engine.generate(prompt, v.mode, max_tokens=max_tokens, recompute_ratio=v.ratio)
            row["order"].append(v.name)
        for v in variants:
            g = gens[v.name]
            rec = _record(g)
            rec.update(agree_rouge_l=_r(rouge_l(g.text, gens["full"].text)),
                       speedup=_r(gens["full"].metrics.ttft_s / g.metrics.ttft_s) if g.metrics.ttft_s > 0 else None)
            row["results"][v.name] = rec
            if v.mode in ("reuse", "blend"):
                served.update(g.metrics.chunk_tiers)
        records.append(row)
        seen |= ids
        prev = ids
        say(f"[{i + 1}/{len(questions)}] " + "  ".join(f"{v.name} {row['results'][v.name]['ttft_s']:.2f}s"
                                                       for v in variants))
        if checkpoint is not None and i + 1 < len(questions):
            checkpoint({**_hotset_result(engine, variants, questions, sets, records, pre, ingest_s, window,
                                         max_tokens, before, served), "partial": True})
    return _hotset_result(engine, variants, questions, sets, records, pre, ingest_s, window, max_tokens, before,
                          served)


def _hotset_result(engine: "BlendEngine", variants: Sequence[Variant], questions: Sequence[HotQuestion],
                   sets: Sequence[Sequence[Chunk]], records: list[dict[str, Any]], pre: dict[str, Any],
                   ingest_s: float, window: int, max_tokens: int, before: Mapping[str, Any],
                   served: Counter[str]) -> dict[str, Any]:
    after = engine.store_stats()
    summary = {}
    for v in variants:
        ttft = [r["results"][v.name]["ttft_s"] for r in records]
        sp = [r["results"][v.name]["speedup"] for r in records]
        first, last = median(sp[:window]), median(sp[-window:])
        summary[v.name] = {
            "mode": v.mode, "recompute_ratio": v.ratio, "n": len(ttft),
            "ttft_median_s": _r(median(ttft)), "ttft_p90_s": _r(percentile(ttft, 90)),
            "ttft_first_median_s": _r(median(ttft[:window])), "ttft_last_median_s": _r(median(ttft[-window:])),
            "speedup_median": _r(median(sp), 3), "speedup_first_median": _r(first, 3),
            "speedup_last_median": _r(last, 3),
            "last_vs_first": _r(last / first, 3) if (first and last) else None,
            "agree_rouge_l_mean": _r(mean(r["results"][v.name]["agree_rouge_l"] for r in records)),
        }
    total_served = sum(served.values())
    name = ratio_name(engine.settings.blend.recompute_ratio)
    targets = {}
    if name in summary:
        targets["hotset_last_vs_first"] = _target(summary[name]["last_vs_first"], TARGETS["hotset_last_vs_first_min"],
                                                  "min", f"median blend speedup, last {window} / first {window} questions")
    return {
        "benchmark": "hotset", "n": len(records), "window": window, "max_tokens": max_tokens,
        "passages": len(questions[0].passages) if questions else 0, "hot_per_question": questions[0].hot if questions else 0,
        "distinct_chunks": len({c.chunk_id for s in sets for c in s}), "ingest": {**pre, "wall_s": _r(ingest_s, 2)},
        "overlap_seen_before_mean": _r(mean(r["seen_before"] for r in records)),
        "jaccard_prev_mean": _r(mean(r["jaccard_prev"] for r in records)),
        "modes": summary, "tier_hit_rates": _tier_delta(before, after),
        "served_by_tier": {t: _r(n / total_served) for t, n in served.most_common()} if total_served else {},
        "targets": targets, "questions": records,
    }


# =================================================================================================
# bench throughput: batches of concurrent requests
# =================================================================================================


def run_throughput(engine: "BlendEngine", examples: Sequence[QAExample], *, concurrency: Sequence[int] = (1, 4, 8, 16),
                   modes: Sequence[str] = ("full", "blend"), passages: int = 3, max_tokens: int = 16,
                   progress: Progress | None = None) -> dict[str, Any]:
    """Requests/s and prompt tokens/s of ``generate_many`` batches of C distinct prompts per mode.

    The prompts of the first ``max(concurrency)`` examples (``passages`` passages each) are
    ingested first; each (C, mode) batch runs once, modes alternating first per C, after one
    untimed warm-up request per mode. Every request decodes ``max_tokens`` tokens (greedy).
    """
    say = progress or (lambda _msg: None)
    n = max(concurrency)
    if len(examples) < n:
        raise BenchConfigError(f"concurrency {n} needs {n} examples; got {len(examples)}")
    prompts = []
    all_chunks = []
    for ex in examples[:n]:
        chunks = make_chunks(engine.tokenizer, ex.passages[:passages])
        all_chunks += chunks
        prompts.append(engine.prompts.build(ex.question, chunks))
    pre = engine.precompute(_distinct(all_chunks))
    for m in modes:
        engine.generate(prompts[0], m, max_tokens=2)
    rows = []
    for j, c in enumerate(concurrency):
        for m in rotated(list(modes), j):
            batch = prompts[:c]
            t0 = time.perf_counter()
            gens = engine.generate_many(batch, m, max_tokens=max_tokens)
            wall = time.perf_counter() - t0
            ptoks = sum(len(p.token_ids) for p in batch)
            otoks = sum(len(g.token_ids) for g in gens)
            ttft = [g.metrics.ttft_s for g in gens]
            rows.append({"concurrency": c, "mode": m, "wall_s": _r(wall, 3), "requests_per_s": _r(c / wall),
                         "prompt_tokens_per_s": _r(ptoks / wall, 1), "output_tokens_per_s": _r(otoks / wall, 2),
                         "prompt_tokens": ptoks, "output_tokens": otoks, "ttft_median_s": _r(median(ttft)),
                         "ttft_max_s": _r(max(ttft))})
            say(f"C={c} {m}: {c / wall:.3f} req/s, {ptoks / wall:.0f} prompt tok/s, wall {wall:.1f} s")
    ratios = []
    for c in concurrency:
        by = {r["mode"]: r for r in rows if r["concurrency"] == c}
        if "full" in by and "blend" in by:
            ratios.append({"concurrency": c, "blend_vs_full_requests_per_s":
                           _r(by["blend"]["requests_per_s"] / by["full"]["requests_per_s"], 3)})
    return {"benchmark": "throughput", "passages": passages, "max_tokens": max_tokens,
            "prompt_tokens_mean": _r(mean(len(p.token_ids) for p in prompts), 1), "precompute": pre,
            "rows": rows, "blend_vs_full": ratios}


# =================================================================================================
# bench ingest: KV precompute speed next to vLLM's own prefill
# =================================================================================================


def run_ingest(engine: "BlendEngine", examples: Sequence[QAExample], *, passages: int = 10,
               progress: Progress | None = None) -> dict[str, Any]:
    """KV precompute tokens/s next to vLLM prefill tokens/s for the same chunks.

    Both process ``[prompt head][chunk unit]`` per chunk (precompute keeps the unit's KV; vLLM
    prefills the same tokens as a prompt with max_tokens=1); tokens/s counts unit tokens only.
    The chunks' stored KV is deleted first so precompute really computes; its time includes
    storing (top memory tier plus write-through to the persistent tiers configured). vLLM is
    measured one chunk at a time (as precompute works) and as one batch.
    """
    say = progress or (lambda _msg: None)
    chunks = _distinct(c for ex in examples for c in make_chunks(engine.tokenizer, ex.passages[:passages]))
    warm_up(engine, chunks[:1])  # one-time costs of both paths (the chunk's KV is forgotten next)
    engine.forget(chunks)
    t0 = time.perf_counter()
    pre = engine.precompute(chunks)
    pre_wall = time.perf_counter() - t0
    unit_tokens = sum(len(engine.prompts.unit_ids(c)) for c in chunks)
    head = list(engine.prompts.head_ids)
    prompts = [AssembledPrompt(head + engine.prompts.unit_ids(c), [], 0, len(head)) for c in chunks]
    say(f"precompute: {len(chunks)} chunks, {unit_tokens} tokens in {pre['seconds']:.1f} s")
    t0 = time.perf_counter()
    single = [engine.generate(p, "full", max_tokens=1) for p in prompts]
    seq_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate_many(prompts, "full", max_tokens=1)
    batch_wall = time.perf_counter() - t0
    ttft_sum = sum(g.metrics.ttft_s for g in single)
    out = {
        "benchmark": "ingest", "chunks": len(chunks), "unit_tokens": unit_tokens, "head_tokens": len(head),
        "precompute": {"computed": pre["computed"], "seconds": _r(pre["seconds"], 3), "wall_s": _r(pre_wall, 3),
                       "tokens_per_s": _r(unit_tokens / pre["seconds"], 1)},
        "vllm_prefill_sequential": {"wall_s": _r(seq_wall, 3), "ttft_sum_s": _r(ttft_sum, 3),
                                    "tokens_per_s": _r(unit_tokens / ttft_sum, 1)},
        "vllm_prefill_batch": {"wall_s": _r(batch_wall, 3), "tokens_per_s": _r(unit_tokens / batch_wall, 1)},
    }
    out["precompute_vs_prefill_sequential"] = _r(out["precompute"]["tokens_per_s"]
                                                  / out["vllm_prefill_sequential"]["tokens_per_s"], 3)
    out["precompute_vs_prefill_batch"] = _r(out["precompute"]["tokens_per_s"]
                                            / out["vllm_prefill_batch"]["tokens_per_s"], 3)
    return out


# =================================================================================================
# bench tiers: blend TTFT with chunk KV served from cpu, disk, Redis (one engine per tier layout)
# =================================================================================================

#: store overrides per tier layout. ``cpu`` and ``disk`` share one disk folder (the KV is computed
#: once for both; in ``cpu`` an untimed request first promotes it into the cpu tier, which lookups
#: reach first); ``remote`` has Redis alone.
TIER_LAYOUTS: dict[str, dict[str, Any]] = {
    "cpu": {"cpu_kv_pool_gb": 8.0, "ssd_cache_max_gb": 50.0, "remote_url": ""},
    "disk": {"cpu_kv_pool_gb": 0.0, "ssd_cache_max_gb": 50.0, "remote_url": ""},
    "remote": {"cpu_kv_pool_gb": 0.0, "ssd_cache_max_gb": 0.0},
}


class LocalRedis:
    """A throwaway ``redis-server`` on a free loopback port (``url``); ``stop()`` kills it."""

    def __init__(self, workdir: Path):
        import socket

        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install -y redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def drop_page_cache(folder: Path) -> int:
    """Drop ``folder``'s files from the OS page cache (fsync + POSIX_FADV_DONTNEED); returns files dropped.

    Only these files are affected (no root, no global drop_caches), so the next read is a real
    disk read.
    """
    n = 0
    for path in folder.rglob("*"):
        if not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


def _tiers_child(layout: str, settings_file: str | None, store: dict[str, Any], engine_over: dict[str, Any],
                 examples: list[dict[str, Any]], passages: int, repeats: int, queue: Any) -> None:
    """One tier layout in a fresh process (the store's tiers are fixed when the engine starts)."""
    try:
        queue.put(_tiers_layout(layout, settings_file, store, engine_over,
                                [QAExample(**e) for e in examples], passages, repeats))
    except BaseException as exc:  # report, never hang the parent
        queue.put({"layout": layout, "error": f"{type(exc).__name__}: {exc}"})


def _tiers_layout(layout: str, settings_file: str | None, store: dict[str, Any], engine_over: dict[str, Any],
                  examples: Sequence[QAExample], passages: int, repeats: int) -> dict[str, Any]:
    from ragcache.engine import BlendEngine

    settings = Settings.load(settings_file, store=store, engine=engine_over)
    engine = BlendEngine(settings)
    try:
        setups = [(layout, False)] + ([("disk-cold", True)] if layout == "disk" else [])
        rows = []
        for i, ex in enumerate(examples):
            chunks = make_chunks(engine.tokenizer, ex.passages[:passages])
            engine.precompute(chunks)
            prompt = engine.prompts.build(ex.question, chunks)
            # untimed: the first requests pay one-time costs, and in ``cpu`` this promotes KV found on disk
            engine.generate(prompt, "blend", max_tokens=1)
            ref = engine.generate(prompt, "full", max_tokens=1).metrics.ttft_s if layout == "cpu" else None
            for rep in range(repeats):
                for name, cold in setups:
                    for overlap in rotated([True, False], i + rep):
                        if cold:
                            drop_page_cache(Path(settings.store.ssd_cache_dir))
                        engine.settings.blend.pipeline_overlap = overlap
                        g = engine.generate(prompt, "blend", max_tokens=1)
                        m = g.metrics
                        rows.append({"tier": name, "pipeline_overlap": overlap, "example": ex.index, "repeat": rep,
                                     "ttft_s": _r(m.ttft_s), "load_s": _r(m.load_s), "worker_s": _r(m.worker_s),
                                     "ctx_tokens": m.ctx_tokens, "served_by": sorted(set(m.chunk_tiers)),
                                     "full_ttft_s": _r(ref)})
        return {"layout": layout, "startup_s": round(engine.startup_s, 1), "rows": rows}
    finally:
        engine.close()


def run_tiers(settings_file: str | None, examples: Sequence[QAExample], *, kv_root: Path, passages: int = 10,
              repeats: int = 2, layouts: Sequence[str] = ("cpu", "disk", "remote"),
              engine_overrides: Mapping[str, Any] | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Blend TTFT with the chunk KV in exactly one tier, pipeline_overlap on and off.

    One engine per layout, each in its own process, since the tiers are fixed at engine start:
    ``cpu`` (served by the cpu pool; see :data:`TIER_LAYOUTS`), ``disk`` (disk only; served warm
    from the page cache, and ``disk-cold`` after dropping the KV files from the page cache; the
    row's ``served_by`` says which tier served), ``remote`` (Redis only: a throwaway
    redis-server on a loopback port; skipped when redis-server is missing). Per example and repeat,
    both overlap settings run in rotated order. ``full`` TTFT is measured in the cpu layout as a
    reference. Ratios are medians of per-example, per-repeat ratios to the cpu tier (same overlap).
    """
    import multiprocessing as mp

    say = progress or (lambda _msg: None)
    payload = [asdict(e) for e in examples]
    results: dict[str, Any] = {}
    notes = []
    redis: LocalRedis | None = None
    ctx = mp.get_context("spawn")
    try:
        for layout in layouts:
            store = {**TIER_LAYOUTS[layout], "ssd_cache_dir": str(kv_root / ("remote" if layout == "remote" else "disk"))}
            if layout == "remote":
                try:
                    redis = LocalRedis(kv_root / "redis")
                except (FileNotFoundError, RuntimeError) as exc:
                    notes.append(f"remote tier skipped: {exc}")
                    continue
                store["remote_url"] = redis.url
            say(f"tier layout {layout}: starting an engine")
            queue = ctx.Queue()
            proc = ctx.Process(target=_tiers_child, args=(layout, None if settings_file is None else str(settings_file),
                                                          store, dict(engine_overrides or {}), payload, passages,
                                                          repeats, queue))
            proc.start()
            res = queue.get()
            proc.join()
            if "error" in res:
                raise RuntimeError(f"tier layout {layout} failed: {res['error']}")
            results[layout] = res
            say(f"tier layout {layout}: done ({len(res['rows'])} requests)")
            if redis is not None:
                redis.stop()
                redis = None
    finally:
        if redis is not None:
            redis.stop()
    rows = [r for res in results.values() for r in res["rows"]]
    cpu = {(r["example"], r["repeat"], r["pipeline_overlap"]): r["ttft_s"] for r in rows if r["tier"] == "cpu"}
    summary = []
    for tier in dict.fromkeys(r["tier"] for r in rows):
        for overlap in (True, False):
            sel = [r for r in rows if r["tier"] == tier and r["pipeline_overlap"] == overlap]
            if not sel:
                continue
            ratio = [r["ttft_s"] / cpu[k] for r in sel
                     if (k := (r["example"], r["repeat"], overlap)) in cpu and cpu[k]]
            summary.append({
                "tier": tier, "pipeline_overlap": overlap, "n": len(sel),
                "ttft_median_s": _r(median([r["ttft_s"] for r in sel])),
                "ttft_p90_s": _r(percentile([r["ttft_s"] for r in sel], 90)),
                "load_s_median": _r(median([r["load_s"] for r in sel])),
                "worker_s_median": _r(median([r["worker_s"] for r in sel])),
                "vs_cpu_median": _r(median(ratio), 3),
                "served_by": sorted({t for r in sel for t in r["served_by"]}),
            })
    full = [r["full_ttft_s"] for r in rows if r["full_ttft_s"] is not None]
    targets = {}
    disk_on = next((s for s in summary if s["tier"] == "disk" and s["pipeline_overlap"]), None)
    if disk_on:
        targets["disk_vs_cpu"] = _target(disk_on["vs_cpu_median"], TARGETS["disk_vs_cpu_ttft_max"], "max",
                                         "median TTFT(disk)/TTFT(cpu), pipeline_overlap on, page cache warm")
    cold_on = next((s for s in summary if s["tier"] == "disk-cold" and s["pipeline_overlap"]), None)
    if cold_on:
        targets["disk_cold_vs_cpu"] = _target(cold_on["vs_cpu_median"], TARGETS["disk_vs_cpu_ttft_max"], "max",
                                              "as disk_vs_cpu with the KV files dropped from the page cache")
    return {"benchmark": "tiers", "n": len(examples), "passages": passages, "repeats": repeats,
            "full_ttft_median_s": _r(median(full)), "summary": summary, "targets": targets, "notes": notes,
            "startup_s": {k: v["startup_s"] for k, v in results.items()}, "rows": rows}


# =================================================================================================
# Presentation: tables, plots, files
# =================================================================================================


def _fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.1f}" if abs(v) >= 100 else f"{v:.{nd}f}"
    return str(v)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned table (numbers right-aligned)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    for r in cells:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The same table as GitHub markdown (a ``|`` inside a cell is escaped so it does not split it)."""
    def cell(v: Any) -> str:
        return _fmt(v).replace("|", "\\|")

    out = ["| " + " | ".join(map(cell, headers)) + " |",
           "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(out)


def _pct(v: float | None) -> float | None:
    return None if v is None else round(100.0 * v, 2)


def tables(result: Mapping[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """``(title, headers, rows)`` for a result of any benchmark."""
    kind = result["benchmark"]
    if kind == "ttft":
        h = ["mode", "TTFT med (s)", "TTFT p90 (s)", "speedup", "KL vs full", "gold NLL", "NLL vs full %",
             "F1", "Rouge-L", "agree EM", "agree Rouge-L", "recomputed %"]

        def row(name: str, s: Mapping[str, Any]) -> list[Any]:
            return [name, s["ttft_median_s"], s["ttft_p90_s"], s["speedup_median"], s["kl_mean"], s["gold_nll_mean"],
                    _pct(s["gold_nll_rel_full"]), s["f1_mean"], s["rouge_l_mean"], s["agree_em_mean"],
                    s["agree_rouge_l_mean"], _pct(s["recomputed_frac_mean"])]
        main = [row(k if k != "blend" else f"blend (r={s['recompute_ratio']:g})", s) for k, s in result["modes"].items()]
        sweep = [row(f"r={s['recompute_ratio']:g}", s) for s in result["sweep"]]
        if "reuse" in result["modes"]:
            sweep.insert(0, row("reuse", result["modes"]["reuse"]))
        out = [(f"TTFT and quality by mode (n={result['n']}, {result['passages']} passages)", h, main)]
        if len(result["sweep"]) > 1:
            out.append(("recompute-ratio sweep (blend)", h, sweep))
        return out
    if kind == "eval":
        h = ["mode", "n", "KL vs full", "gold NLL", "NLL vs full %", "F1", "Rouge-L", "EM", "agree EM",
             "agree Rouge-L"]
        rows = []
        for name, s in (("full", result["full"]), (result["mode"], result["quality"])):
            rows.append([name, s["n"], s["kl_mean"], s["gold_nll_mean"], _pct(s["gold_nll_rel_full"]), s["f1_mean"],
                         s["rouge_l_mean"], s["em_mean"], s["agree_em_mean"], s["agree_rouge_l_mean"]])
        return [(f"quality (n={result['n']})", h, rows)]
    if kind == "hotset":
        w = result["window"]
        h = ["mode", "TTFT med (s)", "TTFT p90 (s)", "speedup", f"first-{w} speedup", f"last-{w} speedup",
             "last/first", "agree Rouge-L"]
        rows = [[k, s["ttft_median_s"], s["ttft_p90_s"], s["speedup_median"], s["speedup_first_median"],
                 s["speedup_last_median"], s["last_vs_first"], s["agree_rouge_l_mean"]]
                for k, s in result["modes"].items()]
        th = ["tier", "hits", "misses", "hit rate", "entries", "share of chunk loads"]
        served = result.get("served_by_tier", {})
        trows = [[k, t["hits"], t["misses"], t["hit_rate"], t["entries"], _pct(served.get(k, 0.0))]
                 for k, t in result["tier_hit_rates"].items()]
        if served.get("computed"):
            trows.append(["computed (miss)", None, None, None, None, _pct(served["computed"])])
        return [(f"hotset (n={result['n']} questions, {result['passages']} passages, "
                 f"{_pct(result['overlap_seen_before_mean'])}% of each set seen before)", h, rows),
                ("store hit rates over the sequence (lookups reaching each tier) and the tiers that served "
                 "reuse/blend chunk loads (%)", th, trows)]
    if kind == "throughput":
        h = ["C", "mode", "req/s", "prompt tok/s", "output tok/s", "TTFT med (s)", "wall (s)"]
        rows = [[r["concurrency"], r["mode"], r["requests_per_s"], r["prompt_tokens_per_s"], r["output_tokens_per_s"],
                 r["ttft_median_s"], r["wall_s"]] for r in result["rows"]]
        rh = ["C", "blend/full req/s"]
        rr = [[r["concurrency"], r["blend_vs_full_requests_per_s"]] for r in result["blend_vs_full"]]
        return [(f"throughput ({result['prompt_tokens_mean']:.0f}-token prompts)", h, rows),
                ("blend over full", rh, rr)]
    if kind == "tiers":
        h = ["tier", "overlap", "n", "TTFT med (s)", "TTFT p90 (s)", "load (s)", "worker (s)", "vs cpu"]
        rows = [[s["tier"], s["pipeline_overlap"], s["n"], s["ttft_median_s"], s["ttft_p90_s"], s["load_s_median"],
                 s["worker_s_median"], s["vs_cpu_median"]] for s in result["summary"]]
        return [(f"blend TTFT by tier (n={result['n']}, full TTFT median {result['full_ttft_median_s']} s)", h, rows)]
    if kind == "ingest":
        h = ["path", "tokens/s", "seconds"]
        rows = [["KV precompute (ragcache)", result["precompute"]["tokens_per_s"], result["precompute"]["seconds"]],
                ["vLLM prefill, one chunk at a time", result["vllm_prefill_sequential"]["tokens_per_s"],
                 result["vllm_prefill_sequential"]["ttft_sum_s"]],
                ["vLLM prefill, one batch", result["vllm_prefill_batch"]["tokens_per_s"],
                 result["vllm_prefill_batch"]["wall_s"]]]
        return [(f"ingest ({result['chunks']} chunks, {result['unit_tokens']} tokens)", h, rows)]
    raise ValueError(f"unknown benchmark {kind!r}")


def targets_table(result: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]] | None:
    t = result.get("targets") or {}
    if not t:
        return None
    limit = {"min": "\u2265 {}", "max": "\u2264 {}", "max_abs": "|x| \u2264 {}"}
    rows = [[k, v["value"], next(limit[kind].format(_fmt(v[kind])) for kind in limit if kind in v), v["met"], v["note"]]
            for k, v in t.items()]
    return ["target", "value", "limit", "met", "measured as"], rows


def render(result: Mapping[str, Any], markdown: bool = False) -> str:
    """All tables of a result (and its targets), as text or markdown."""
    fn = markdown_table if markdown else text_table
    parts = []
    for title, h, rows in tables(result):
        parts.append((f"**{title}**\n\n" if markdown else f"{title}\n") + fn(h, rows))
    tt = targets_table(result)
    if tt:
        parts.append(("**targets**\n\n" if markdown else "targets\n") + fn(*tt))
    return "\n\n".join(parts)


def _log_axis(axis: Any) -> None:
    """Log scale with plain tick labels at 1, 2, 5 x 10^k."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.axes.set_xscale("log") if axis.axis_name == "x" else axis.axes.set_yscale("log")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot(result: Mapping[str, Any], path: Path) -> Path | None:
    """A PNG for ttft (quality vs TTFT), hotset (TTFT over the sequence) and throughput; None otherwise."""
    kind = result["benchmark"]
    if kind not in ("ttft", "hotset", "throughput"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if kind == "ttft":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, key, label in ((axes[0], "kl_mean", "first-token KL(full || mode), nats"),
                               (axes[1], "gold_nll_mean", "gold-answer NLL, nats/token")):
            sweep = [s for s in result["sweep"] if s[key] is not None]
            ax.plot([s["ttft_median_s"] for s in sweep], [s[key] for s in sweep], "o-", color="tab:blue",
                    label="blend (recompute ratio)")
            for s in sweep:
                ax.annotate(f"{s['recompute_ratio']:g}", (s["ttft_median_s"], s[key]), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
            for name, marker, color in (("full", "s", "black"), ("prefix", "^", "tab:green"), ("reuse", "x", "tab:red")):
                s = result["modes"].get(name)
                if s and s[key] is not None:
                    ax.plot([s["ttft_median_s"]], [s[key]], marker, color=color, markersize=8, label=name)
            _log_axis(ax.xaxis)
            ax.set_xlabel("median TTFT (s, log scale)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"quality vs TTFT, n={result['n']} ({result['passages']} passages per prompt)")
    elif kind == "hotset":
        fig, ax = plt.subplots(figsize=(9, 4))
        for name in result["modes"]:
            ax.plot(range(1, result["n"] + 1), [q["results"][name]["ttft_s"] for q in result["questions"]], ".-",
                    label=name)
        _log_axis(ax.yaxis)
        ax.set_xlabel("question in sequence")
        ax.set_ylabel("TTFT (s, log scale)")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title("hotset: TTFT over the question sequence")
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
        for m in dict.fromkeys(r["mode"] for r in result["rows"]):
            rows = [r for r in result["rows"] if r["mode"] == m]
            ax.plot([r["concurrency"] for r in rows], [r["requests_per_s"] for r in rows], "o-", label=m)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("requests/s")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title("throughput: generate_many batches")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_result(result: dict[str, Any], out: Path, *, with_plot: bool = True) -> dict[str, Path]:
    """Write ``out`` (JSON), ``out`` with .md (the tables) and, where there is one, .png (the plot)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = {"json": out}
    png = out.with_suffix(".png")
    if with_plot and plot(result, png) is not None:
        result["plot"] = png.name
        paths["png"] = png
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    md = out.with_suffix(".md")
    header = (f"Measured {result.get('started', '')} on {result.get('machine', {}).get('cpu_count', '?')} cores "
              f"({result.get('machine', {}).get('cpu_model', 'unknown CPU')}), load average at start "
              f"{result.get('machine', {}).get('load_avg_1_5_15')}.\n\n")
    md.write_text(header + render(result, markdown=True) + "\n", encoding="utf-8")
    paths["md"] = md
    return paths


def stamp(result: dict[str, Any], *, command: str, engine: "BlendEngine | None" = None,
          dataset: str | None = None, started: str | None = None) -> dict[str, Any]:
    """Add the command line, time, machine and engine settings to a result (in place) and return it."""
    head = {"benchmark": result["benchmark"], "command": command, "started": started or _now(), "finished": _now(),
            "dataset": dataset, "machine": machine_info()}
    if engine is not None:
        head["engine"] = _engine_info(engine)
    rest = {k: v for k, v in result.items() if k not in head}
    result.clear()
    result.update(head)
    result.update(rest)
    return result


def command_line() -> str:
    return "ragcache " + " ".join(sys.argv[1:])
