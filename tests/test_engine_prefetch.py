"""ragcache.engine.worker.prefetch_layers: when the blend loads the next layer in a background thread;
and what the streamed loader does in that thread when a chunk turns out damaged."""

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from kv_fixtures import SPEC, make_kv, poison

from ragcache.blend import LoadOnCaller
from ragcache.config import BlendSettings
from ragcache.engine.messages import BlendParams, LoadRequest, SegmentRef
from ragcache.engine.worker import _MemoryHandle, _Opened, _streamed_loader, prefetch_layers
from ragcache.kvstore import DiskTier, TieredStore
from ragcache.options import QueryOptions

CPU, ACCELERATOR = torch.device("cpu"), torch.device("meta")  # any non-CPU device type stands for an accelerator


@pytest.mark.parametrize("tiers", [["cpu", "cpu"], ["cpu", "disk"], ["disk"], ["computed", "cpu"]])
def test_auto_keeps_cpu_compute_over_local_kv_on_one_thread(tiers):
    assert prefetch_layers("auto", CPU, tiers) is False


def test_auto_overlaps_a_remote_read_or_an_accelerator():
    assert prefetch_layers("auto", CPU, ["cpu", "remote"]) is True
    assert prefetch_layers("auto", ACCELERATOR, ["cpu"]) is True


@pytest.mark.parametrize("setting", [True, False])
def test_an_explicit_setting_wins(setting):
    for device, tiers in ((CPU, ["cpu"]), (CPU, ["remote"]), (ACCELERATOR, ["disk"])):
        assert prefetch_layers(setting, device, tiers) is setting


@pytest.mark.parametrize("value", ["auto", True, False])
def test_the_setting_crosses_the_connector_unchanged(value):
    from ragcache.config import BlendSettings
    from ragcache.options import QueryOptions

    blend = BlendSettings(pipeline_overlap=value)
    params = BlendParams.from_options(blend, QueryOptions(), mode="blend", ctx_len=4, lead_in_len=1, segments=(),
                                      question_end=0)
    assert BlendParams.from_dict(params.to_dict()).blend.pipeline_overlap == value
    with pytest.raises(ValueError, match="pipeline_overlap"):
        d = params.to_dict()
        BlendParams.from_dict({**d, "blend": {**d["blend"], "pipeline_overlap": "yes"}})


class _Recomputing:
    """The two things of WorkerRuntime the streamed loader uses: the model's layout, and the
    recompute of a damaged segment (here: its original K/V, and on which thread it ran)."""

    def __init__(self, kv: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.ops = SimpleNamespace(device=torch.device("cpu"), dtype=SPEC.dtype, num_layers=SPEC.num_layers)
        self.kv = kv
        self.threads: list[tuple[str, int]] = []

    def _compute_for_request(self, key, head_ids, start, unit, context_ids=()):
        self.threads.append((key, threading.get_ident()))
        return _MemoryHandle(*self.kv[key])


def test_a_chunk_found_damaged_by_the_prefetch_thread_is_recomputed_on_the_callers_thread(tmp_path):
    """The recompute is a model forward; beside the blend's own on another thread it would share
    vLLM's CPU GEMM scratch buffer (results corrupted, or a crash). The prefetch thread hands the
    layer back (LoadOnCaller) and the caller's thread recomputes the chunk when it loads it again."""
    kv = {"a": make_kv(1), "b": make_kv(2)}
    store = TieredStore(SPEC, [(DiskTier(tmp_path), None)], kv_compression="int8")
    for key, (k, v) in kv.items():
        store.put(key, k, v, 0)
    path = DiskTier(tmp_path).path("b")
    path.write_bytes(poison(path.read_bytes(), "k_scale.2", float("inf")))  # checksums pass, layer 2 is bad

    n = 12
    params = BlendParams.from_options(BlendSettings(), QueryOptions(), mode="reuse", ctx_len=n, lead_in_len=0,
                                      segments=(SegmentRef("a", 0, 6), SegmentRef("b", 6, 6)))
    opened = _Opened(LoadRequest(req_id="r", params=params, token_ids=list(range(n)), block_ids=[]))
    for key in kv:
        opened.handles.append(store.open(key))
        opened.tiers.append("disk")
    runtime = _Recomputing(kv)
    reads = []  # the layers read from chunk a's handle
    handle_a, stored_layer = opened.handles[0], opened.handles[0].stored_layer
    handle_a.stored_layer = lambda i: reads.append(i) or stored_layer(i)
    load_layer = _streamed_loader([opened], runtime)

    k1, _ = load_layer(1)  # undamaged layers load on any thread
    with ThreadPoolExecutor(1) as pool:
        assert torch.equal(pool.submit(load_layer, 1).result()[0], k1)
        with pytest.raises(LoadOnCaller, match="segment 1 needs recomputing at layer 2"):
            pool.submit(load_layer, 2).result()
        assert runtime.threads == []  # nothing computed in the background
        with pytest.raises(LoadOnCaller):  # and still not, if asked again there
            pool.submit(load_layer, 2).result()

    k, v = load_layer(2)
    assert runtime.threads == [("b", threading.get_ident())]
    assert opened.tiers == ["disk", "computed"]
    assert torch.equal(k[6:], kv["b"][0][2]) and torch.equal(v[6:], kv["b"][1][2])  # the recomputed rows
    torch.testing.assert_close(k[:6], kv["a"][0][2], atol=0.05, rtol=0.05)  # the stored chunk, int8
    assert store.stats()["disk"]["corrupt"] == 1  # found once, counted once
    assert reads == [1, 1, 2]  # chunk a's layer 2, read before b's was found damaged, is not read again
    opened.close()
    store.close()
