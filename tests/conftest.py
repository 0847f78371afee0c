"""Shared fixtures: one real vLLM engine per test session (start-up costs 6-30 s).

Integration tests use the real SmolLM2-135M-Instruct through vLLM; they are marked
``integration`` so ``make test-unit`` can skip them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("RAGCACHE_DATA_DIR") or REPO.parent / "shared" / "data")
if SHARED_DATA.is_dir():  # the benchmarks read the public sets from $RAGCACHE_DATA_DIR alone (subprocesses too)
    os.environ.setdefault("RAGCACHE_DATA_DIR", str(SHARED_DATA))


#: three short documents about a made-up island (one chunk each): facts the small model cannot know
ZORBIA_DOCS = {
    "zorbia.txt": "Zorbia is a small island nation. The Zorbian capital is Velmora, a city on the river Aster "
                  "known for its glass bridges. Velmora was founded in 1432 by the navigator Idris Kell.",
    "food.md": "# Zorbian food\n\nThe national dish of Zorbia is kelmet, a stew of lentils, smoked fish and "
               "saffron. It is served at every wedding.",
    "parliament.txt": "Zorbia's parliament meets in the Amber Hall, which has 212 seats and a copper roof. "
                      "Elections are held every five years.",
}


def clear_ragcache_env(monkeypatch) -> None:
    """Unset every RAGCACHE_* variable for the test (settings come from the test alone)."""
    for name in list(os.environ):
        if name.startswith("RAGCACHE_"):
            monkeypatch.delenv(name)


def shared_data(relative: str) -> Path:
    """Path under ../shared/data, or skip the test with a clear message when it is absent."""
    path = SHARED_DATA / relative
    if not path.exists():
        pytest.skip(f"{path} is absent (the evaluation data lives in ../shared/data beside the repo, "
                    "or set RAGCACHE_DATA_DIR)")
    return path


@pytest.fixture(scope="session")
def engine_settings(tmp_path_factory):
    """Settings for the shared engine: KV store in a temporary folder, no Redis, float32, chunk KV
    stored uncompressed.

    float32 whatever ``dtype = "auto"`` picks on this CPU, and ``store.kv_compression = "none"``
    whatever the default (int8, tests/test_engine_compression.py): the tests on this engine check exactness
    (blend at ratio 1.0 gives full prefill's tokens, reuse at the canonical place equals full), which
    holds up to float32 rounding only; tests/test_engine_bf16.py checks the same invariants in
    bfloat16 with the tolerance bf16 needs, on every CPU. The blend's attention runs on vLLM's
    kernel (what ``blend.attention = "auto"`` picks where the kernel is the faster); the torch path is
    checked by tests/test_blend_*.py and, through the engine, by tests/test_engine_bf16.py. The
    prompts here are short (~100-300 tokens), so ``blend.min_recompute_tokens`` is 0: with the
    default floor a blend of them would recompute every token and test nothing of the blend;
    the floor itself is tested in tests/test_engine_blend.py. ``engine.mode = "blend"``: a request
    that names no mode blends, as these tests of blend's answers expect (``auto``, the product's
    default, would send these ~40-token passages to full prefill); tests/test_pipeline_auto.py asks
    for ``auto`` per request. ``prompt.kv_context_tokens = 0``: chunk KV computed after the head
    alone, as these tests' answers expect: their one-line documents sit right after the head, where
    KV computed after the KV context is further from a full prefill's than KV computed after the
    head (a blend at ratio 0.5 of three of them: answer NLL +24% against full's; docs/fidelity.md).
    The KV context (the default) is served by the other engines of the suite
    (tests/test_engine_compression.py, tests/test_engine_bf16.py, the CLI and demo tests).
    """
    from ragcache.config import Settings

    kv_dir = tmp_path_factory.mktemp("kv")
    return Settings.load(
        store={"ssd_cache_dir": str(kv_dir), "remote_url": "", "cpu_kv_pool_gb": 2.0, "kv_compression": "none"},
        blend={"attention": "kernel", "min_recompute_tokens": 0}, prompt={"kv_context_tokens": 0},
        # multi-process mode here (vLLM's default); the CLI tests run the in-process default
        engine={"max_model_len": 8192, "kv_cache_memory_bytes": 1 << 30, "max_tokens": 24, "in_process": False,
                "dtype": "float32", "mode": "blend"},
    )


@pytest.fixture(scope="session")
def engine(engine_settings):
    """The one BlendEngine of the test session."""
    from ragcache.engine import BlendEngine

    eng = BlendEngine(engine_settings)
    yield eng
    eng.close()
