"""ragcache.engine.worker.prefetch_layers: when the blend loads the next layer in a background thread."""

import pytest
import torch

from ragcache.engine.messages import BlendParams
from ragcache.engine.worker import prefetch_layers

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
