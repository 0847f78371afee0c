"""``bench storage``: what each stored form of chunk KV (``store.kv_compression``) costs and gives.

Owns, per form (``none``, ``int8``, ``int4``): stored bytes per token of real chunks (header, values,
scales) against float32's and the engine dtype's; compress and decompress rates of the codec on real
KV, beside a lossless zlib pass over the quantised bytes (considered for disk and Redis); blend
TTFT with the chunk KV served from the cpu tier, from disk with a cold page cache and from Redis;
first-token KL of blend and reuse from full prefill and the gold answer's NLL. Two engines per form,
each in a child process (the store's tiers and form are fixed at engine start): the first (cpu +
disk + Redis, written through) precomputes, measures quality and cpu TTFT; the second (disk +
Redis, no memory tier) reads the same files and keys, from disk after dropping them from the page
cache (``posix_fadvise(DONTNEED)``, :func:`~ragcache_testing.services.drop_page_cache`), then from
Redis once the files are removed. A throwaway redis-server (:mod:`ragcache_testing.services`) holds
every form's keys (the form is part of each key). Imports the engine only inside the children;
never app/ or ui/.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from ragcache.bench.common import Progress, answer_ids, target
from ragcache.bench.datasets import QAExample, make_chunks
from ragcache.bench.metrics import kl_divergence, mean, mean_nll, median, rounded
from ragcache.config import Settings
from ragcache.options import QueryOptions
from ragcache_testing.services import RedisServer, drop_page_cache

#: the stored forms a run compares by default; ``none`` is the baseline of every ratio
FORMS = ("none", "int8", "int4")
#: the default form (``store.kv_compression``'s default), judged by the targets
DEFAULT_FORM = "int8"
#: a model of the 8B class (Llama-3-8B's KV: 32 layers, 8 KV heads, head size 128), for the cost table
EIGHT_B = {"name": "8B class (32 layers, 8 KV heads x 128)", "shape": (32, 8, 128)}
TARGETS = {
    "stored_bytes_vs_fp32_max": 0.25,     # default form: <= 1/4 of float32's bytes per token
    "strong_bytes_vs_fp32_max": 0.125,    # int4: <= 1/8
    "kl_vs_uncompressed_max": 1.10,       # blend's and reuse's first-token KL within +10% of uncompressed
    "gold_nll_vs_uncompressed_max": 1.01,  # gold NLL within 1%
    "cpu_ttft_vs_uncompressed_max": 1.03,  # cpu-tier blend TTFT within 3%
    "slow_tier_ttft_vs_uncompressed_max": 1 / 1.5,  # Redis and cold disk: >= 1.5x lower
}
BLEND_1 = QueryOptions(mode="blend", max_tokens=1)
MB = 1e6


def _store(form: str, kv_dir: Path, redis_url: str, cpu: bool) -> dict[str, Any]:
    return {"kv_compression": form, "ssd_cache_dir": str(kv_dir), "ssd_cache_max_gb": 50.0, "remote_url": redis_url,
            "cpu_kv_pool_gb": 8.0 if cpu else 0.0}


def _child(phase: str, settings_file: str | None, store: dict[str, Any], examples: list[dict[str, Any]],
           passages: int, repeats: int, queue: Any) -> None:
    """One engine in a fresh process: ``write`` (precompute, quality, cpu TTFT) or ``read`` (cold
    disk, then Redis TTFT)."""
    try:
        run = _write_phase if phase == "write" else _read_phase
        queue.put(run(settings_file, store, [QAExample(**e) for e in examples], passages, repeats))
    except BaseException as exc:  # report, never hang the parent
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def _timed(engine: Any, prompt: Any, tier: str, form: str, example: int, repeat: int) -> dict[str, Any]:
    m = engine.generate(prompt, BLEND_1).metrics
    return {"form": form, "tier": tier, "example": example, "repeat": repeat, "ttft_s": rounded(m.ttft_s),
            "load_s": rounded(m.load_s), "served_by": sorted(set(m.chunk_tiers)), "ctx_tokens": m.ctx_tokens}


def _write_phase(settings_file: str | None, store: dict[str, Any], examples: Sequence[QAExample], passages: int,
                 repeats: int) -> dict[str, Any]:
    from ragcache.calibrate import EXACT
    from ragcache.engine import BlendEngine

    engine = BlendEngine(Settings.load(settings_file, store=store))
    form = store["kv_compression"]
    try:
        quality, rows, keys = [], [], []
        for i, ex in enumerate(examples):
            chunks = make_chunks(engine.tokenizer, ex.passages[:passages])
            engine.precompute(chunks)
            keys += [engine.prompts.key(c) for c in chunks] + [engine.prompts.head_key]
            prompt = engine.prompts.build(ex.question, chunks)
            engine.generate(prompt, BLEND_1)  # untimed: one-time costs
            gens = {mode: engine.generate(prompt, QueryOptions(mode=mode, max_tokens=1), logprobs=-1)
                    for mode in ("full", "reuse", "blend")}
            gold = answer_ids(engine, ex.answers[0]) if ex.answers else []
            rec = {"example": ex.index, "ctx_tokens": prompt.ctx_len}
            for mode, g in gens.items():
                if mode != "full":
                    rec[f"{mode}_kl"] = rounded(kl_divergence(gens["full"].first_token_logprobs,
                                                              g.first_token_logprobs), 6)
                    rec[f"{mode}_top1_agrees"] = g.token_ids[:1] == gens["full"].token_ids[:1]
                if gold:
                    opts = EXACT if mode == "full" else QueryOptions(mode=mode)
                    rec[f"{mode}_gold_nll"] = rounded(mean_nll(engine.continuation_logprobs(prompt, gold, opts)))
            quality.append(rec)
            rows += [_timed(engine, prompt, "cpu", form, ex.index, rep) for rep in range(repeats)]
        return {"quality": quality, "rows": rows, "keys": sorted(set(keys)), "dtype": engine.dtype.dtype,
                "startup_s": round(engine.startup_s, 1)}
    finally:
        engine.close()


def _read_phase(settings_file: str | None, store: dict[str, Any], examples: Sequence[QAExample], passages: int,
                repeats: int) -> dict[str, Any]:
    from ragcache.engine import BlendEngine

    engine = BlendEngine(Settings.load(settings_file, store=store))
    form, kv_dir = store["kv_compression"], Path(store["ssd_cache_dir"])
    try:
        prompts = [(ex.index, engine.prompts.build(ex.question, make_chunks(engine.tokenizer, ex.passages[:passages])))
                   for ex in examples]
        engine.generate(prompts[0][1], BLEND_1)  # untimed: one-time costs
        rows = []
        for rep in range(repeats):
            for index, prompt in prompts:
                drop_page_cache(kv_dir)
                rows.append(_timed(engine, prompt, "disk-cold", form, index, rep))
        for f in kv_dir.glob("*.safetensors"):  # from now on Redis serves (no memory tier to promote to)
            f.unlink()
        for rep in range(repeats):
            rows += [_timed(engine, prompt, "remote", form, index, rep) for index, prompt in prompts]
        return {"rows": rows, "startup_s": round(engine.startup_s, 1)}
    finally:
        engine.close()


def _in_child(ctx: Any, phase: str, settings_file: str | None, store: dict[str, Any], payload: list[dict[str, Any]],
              passages: int, repeats: int) -> dict[str, Any]:
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(phase, settings_file, store, payload, passages, repeats, queue))
    proc.start()
    res = queue.get()
    proc.join()
    if "error" in res:
        raise RuntimeError(f"{phase} phase of kv_compression {store['kv_compression']} failed: {res['error']}")
    return res


def _footprint(kv_dir: Path, form: str, keys: Sequence[str]) -> dict[str, Any]:
    """Bytes per token of the entries under ``keys`` in ``kv_dir`` (real file sizes), beside what the
    same chunks take uncompressed in float32 and in the model's dtype (header and values)."""
    from ragcache.kvstore.disk import DiskTier
    from ragcache.kvstore.format import entry_nbytes

    disk = DiskTier(kv_dir)
    stored = tokens = fp32 = bf16 = 0
    for key in keys:
        meta = disk.head(key)
        if meta is None:
            continue
        shape = (meta.num_layers, meta.num_kv_heads, meta.head_dim, meta.num_tokens)
        stored += disk.path(key).stat().st_size
        tokens += meta.num_tokens
        fp32 += entry_nbytes(key, *shape, "none", "float32")
        bf16 += entry_nbytes(key, *shape, "none", "bfloat16")
    return {"form": form, "entries": len(keys), "tokens": tokens, "stored_bytes": stored,
            "bytes_per_token": rounded(stored / tokens, 1) if tokens else None,
            "vs_fp32": rounded(stored / fp32, 4) if fp32 else None,
            "vs_16bit": rounded(stored / bf16, 4) if bf16 else None}


def _codec_rates(kv_dir: Path, keys: Sequence[str], spec: Any, forms: Sequence[str],
                 reads: int = 3) -> list[dict[str, Any]]:
    """Compress (``encode``) and decompress (``decode_all``) MB/s of each quantised form on real KV
    (the uncompressed entries under ``keys``), in MB of the model dtype's K/V per second; and zlib
    (level 1) over the quantised bytes: the size it would save and its decode rate."""
    import torch

    from ragcache.kvstore import DiskTier, TieredStore
    from ragcache.kvstore.codec import decode_all, encode, layer_parts

    store = TieredStore(spec, [(DiskTier(kv_dir), None)], kv_compression="none")
    entries = [hit[0] for key in keys if (hit := store.get(key)) is not None]
    store.close()
    raw = sum(e.k.numel() * 2 * e.k.element_size() for e in entries)
    out = []
    for form in forms:
        if form == "none" or not entries:
            continue
        enc_s, dec_s, zdec_s, packed, zipped = [], [], [], 0, 0
        for _ in range(reads):
            t0 = time.perf_counter()
            coded = [encode(e.k, e.v, form, torch.float16) for e in entries]
            enc_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for e, kv in zip(entries, coded):
                decode_all(form, layer_parts(form, torch.float16, *e.k.shape[1:]), kv, spec.dtype, torch.device("cpu"))
            dec_s.append(time.perf_counter() - t0)
            blobs = [zlib.compress(kv.numpy().tobytes(), 1) for kv in coded]
            t0 = time.perf_counter()
            for blob in blobs:
                zlib.decompress(blob)
            zdec_s.append(time.perf_counter() - t0)
            packed, zipped = sum(kv.numel() for kv in coded), sum(len(b) for b in blobs)
        out.append({"form": form, "model_dtype_mb": rounded(raw / MB, 3),
                    "compress_mb_s": rounded(raw / MB / median(enc_s), 1),
                    "decompress_mb_s": rounded(raw / MB / median(dec_s), 1),
                    "zlib_size_vs_quantised": rounded(zipped / packed, 4) if packed else None,
                    "zlib_decode_mb_s": rounded(packed / MB / median(zdec_s), 1)})
    return out


def run_storage(settings_file: str | None, examples: Sequence[QAExample], *, kv_root: Path,
                forms: Sequence[str] = FORMS, passages: int = 10, repeats: int = 2,
                progress: Progress | None = None) -> dict[str, Any]:
    """Bytes, codec rates, TTFT per tier and quality of each stored form (see the module docstring).

    Args:
        settings_file: the user's settings (the store's folder, Redis and form are the run's own).
        examples: QA examples; the first ``passages`` passages of each make its prompt.
        kv_root: a folder for the run's KV (one sub-folder per form) and its redis-server.
        forms: stored forms to compare; must include ``none`` (the baseline of every ratio).
        repeats: timed blend requests per example and tier.

    Returns:
        ``{"benchmark": "storage", "forms", "bytes", "cost_table", "codec", "summary", "targets",
        "quality", "rows", "dtype", "notes"}``; TTFT ratios are ratios of medians (form / none).

    Raises:
        ValueError: ``none`` missing from ``forms``.
        RedisNotInstalledError: no redis-server to measure the remote tier with.
    """
    import multiprocessing as mp

    import torch

    from ragcache.kvstore import KVSpec
    from ragcache.models import resolve_llm

    if "none" not in forms:
        raise ValueError("bench storage compares against uncompressed KV: include none in --forms")
    settings = Settings.load(settings_file)
    llm = resolve_llm(settings.models.model, settings.models.cache_dir)
    say = progress or (lambda _msg: None)
    payload = [asdict(e) for e in examples]
    ctx = mp.get_context("spawn")
    settings_path = None if settings_file is None else str(settings_file)
    written: dict[str, dict[str, Any]] = {}
    read: dict[str, dict[str, Any]] = {}
    sizes = []
    with RedisServer(kv_root / "redis") as redis:
        for form in forms:
            kv_dir = kv_root / form
            say(f"kv_compression {form}: precompute, quality and cpu-tier TTFT")
            written[form] = _in_child(ctx, "write", settings_path, _store(form, kv_dir, redis.url, cpu=True),
                                      payload, passages, repeats)
            sizes.append(_footprint(kv_dir, form, written[form]["keys"]))
            if form == "none":
                spec = KVSpec.from_hf_config(llm.path, llm.fingerprint, dtype=getattr(torch, written[form]["dtype"]))
                say("codec rates on the uncompressed entries")
                codec = _codec_rates(kv_dir, written[form]["keys"], spec, forms)
            say(f"kv_compression {form}: cold disk and Redis TTFT")
            read[form] = _in_child(ctx, "read", settings_path, _store(form, kv_dir, redis.url, cpu=False),
                                   payload, passages, repeats)
    rows = [r for form in forms for r in written[form]["rows"] + read[form]["rows"]]
    quality = {form: written[form]["quality"] for form in forms}
    summary = _summary(forms, rows, quality, sizes)
    return {"benchmark": "storage", "n": len(examples), "passages": passages, "repeats": repeats, "forms": list(forms),
            "dtype": written["none"]["dtype"], "bytes": sizes, "cost_table": cost_table(settings.models.model, spec),
            "codec": codec,
            "summary": summary, "targets": _targets(summary, sizes),
            "startup_s": {f: [written[f]["startup_s"], read[f]["startup_s"]] for f in forms},
            "quality": quality, "rows": rows}


def cost_table(model: str, spec: Any) -> list[dict[str, Any]]:
    """Bytes per token of a 512-token chunk per form, for ``model`` (KV shape from ``spec``) and an
    8B-class model (computed from the format: header, values and scales)."""
    from ragcache.kvstore.format import bytes_per_token

    out = []
    models = ((model, (spec.num_layers, spec.num_kv_heads, spec.head_dim)), (EIGHT_B["name"], EIGHT_B["shape"]))
    for name, shape in models:
        fp32 = bytes_per_token(*shape, "none", "float32")
        for form, dtype in (("none", "float32"), ("none", "bfloat16"), ("int8", "float32"), ("int4", "float32")):
            b = bytes_per_token(*shape, form, dtype)
            out.append({"model": name, "shape": list(shape), "form": form if form != "none" else f"none ({dtype})",
                        "bytes_per_token": round(b), "vs_fp32": rounded(b / fp32, 4),
                        "gb_per_million_tokens": rounded(b * 1e6 / 1e9, 2)})
    return out


def _summary(forms: Sequence[str], rows: Sequence[dict[str, Any]], quality: dict[str, list[dict[str, Any]]],
             sizes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per form: bytes, quality means and TTFT medians per tier, with ratios to ``none``."""
    def ttft(form: str, tier: str) -> float | None:
        return median([r["ttft_s"] for r in rows if r["form"] == form and r["tier"] == tier])

    def q(form: str, name: str) -> float | None:
        return mean(r.get(name) for r in quality[form])

    out = []
    for form in forms:
        size = next(s for s in sizes if s["form"] == form)
        row: dict[str, Any] = {"form": form, "bytes_per_token": size["bytes_per_token"], "vs_fp32": size["vs_fp32"]}
        for name in ("blend_kl", "reuse_kl", "blend_gold_nll", "reuse_gold_nll", "full_gold_nll"):
            row[f"{name}_mean"] = rounded(q(form, name), 5)
            base = q("none", name)
            row[f"{name}_vs_none"] = rounded(q(form, name) / base, 4) if (base and q(form, name) is not None) else None
        for tier in ("cpu", "disk-cold", "remote"):
            row[f"{tier}_ttft_median_s"] = rounded(ttft(form, tier))
            base = ttft("none", tier)
            row[f"{tier}_ttft_vs_none"] = rounded(ttft(form, tier) / base, 4) if (base and ttft(form, tier)) else None
        out.append(row)
    return out


def _targets(summary: Sequence[dict[str, Any]], sizes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    rows = {r["form"]: r for r in summary}
    main = rows.get(DEFAULT_FORM)
    out: dict[str, Any] = {}
    if main is not None:
        out["stored_bytes_vs_fp32"] = target(
            main["vs_fp32"], TARGETS["stored_bytes_vs_fp32_max"], "max",
            "int8: stored bytes per token (header, values, scales) / float32's, same chunks")
        for name, key in (("blend_kl_vs_uncompressed", "blend_kl_vs_none"),
                          ("reuse_kl_vs_uncompressed", "reuse_kl_vs_none")):
            out[name] = target(main[key], TARGETS["kl_vs_uncompressed_max"], "max",
                               f"int8: mean first-token KL(full || {name.split('_')[0]}) / uncompressed's")
        out["blend_gold_nll_vs_uncompressed"] = target(
            main["blend_gold_nll_vs_none"], TARGETS["gold_nll_vs_uncompressed_max"], "max",
            "int8: mean gold-answer NLL of blend / uncompressed blend's")
        out["cpu_ttft_vs_uncompressed"] = target(main["cpu_ttft_vs_none"], TARGETS["cpu_ttft_vs_uncompressed_max"],
                                                 "max", "int8: median blend TTFT from the cpu tier / uncompressed's")
        for name, tier in (("remote_ttft_vs_uncompressed", "remote"), ("disk_cold_ttft_vs_uncompressed", "disk-cold")):
            out[name] = target(main[f"{tier}_ttft_vs_none"], TARGETS["slow_tier_ttft_vs_uncompressed_max"], "max",
                               f"int8: median blend TTFT from {tier} / uncompressed's (<= 1/1.5)")
    strong = rows.get("int4")
    if strong is not None:
        out["strong_bytes_vs_fp32"] = target(strong["vs_fp32"], TARGETS["strong_bytes_vs_fp32_max"], "max",
                                             "int4: stored bytes per token / float32's")
    return out
