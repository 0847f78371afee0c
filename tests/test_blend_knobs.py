"""A request's blend parameters are one record (ragcache.config.BlendKnobs): every [blend] setting
is a field of it, with its default declared once, in BlendSettings, and it travels from the driver
to the worker's blend whole. A new setting reaches the worker with no change but its declaration.
No engine, no model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

from ragcache.config import BlendKnobs, BlendSettings
from ragcache.engine.messages import BlendParams, SegmentRef
from ragcache.options import QueryOptions
from tests.conftest import REPO


def test_every_setting_is_a_field_of_the_record_with_its_one_default():
    assert list(BlendKnobs.model_fields) == list(BlendSettings.model_fields)
    for name, info in BlendKnobs.model_fields.items():
        if name not in ("recompute_ratio", "check_layer"):  # resolved per request: no default of their own
            assert info.default == BlendSettings.model_fields[name].default, name
    assert BlendKnobs.model_fields["recompute_ratio"].is_required()
    assert BlendKnobs.model_fields["check_layer"].is_required()


def test_the_record_crosses_the_connector_whole():
    blend = BlendSettings(granule=4, candidates=3.0, probe_layers=5, chunk_head_tokens=2, recompute_depth=0.75)
    params = BlendParams.from_options(blend, QueryOptions(mode="blend", recompute_ratio=0.25), mode="blend",
                                      ctx_len=12, lead_in_len=2, segments=(SegmentRef("head", 0, 2),))
    back = BlendParams.from_dict(json.loads(json.dumps(params.to_dict())))  # as vLLM carries it: plain data
    assert back == params
    assert back.blend.model_dump() == {**blend.model_dump(), "recompute_ratio": 0.25, "check_layer": 0}


#: the setting the next test declares, in BlendSettings alone
NEW_SETTING = '''
    scratch_knob: int = Field(7, ge=0, description="a setting declared for a test")
'''


def test_a_new_setting_reaches_the_worker_without_another_change(tmp_path):
    """Declare a setting in a copy of ragcache/config.py (nothing else changes): it travels from the
    settings through the request's record and the connector's plain data into the blend's request."""
    shutil.copytree(REPO / "ragcache", tmp_path / "ragcache", ignore=shutil.ignore_patterns("__pycache__"))
    config = tmp_path / "ragcache" / "config.py"
    text = config.read_text(encoding="utf-8")
    anchor = ("class BlendSettings(_Section):\n    \"\"\"CacheBlend selective recompute (Yao et al., EuroSys'25) and "
              "how its tokens are selected.\"\"\"\n")
    assert anchor in text
    config.write_text(text.replace(anchor, anchor + NEW_SETTING), encoding="utf-8")
    code = textwrap.dedent("""
        import json, torch
        import ragcache.config
        from ragcache.config import Settings
        from ragcache.blend import BlendRequest
        from ragcache.engine.messages import BlendParams, SegmentRef
        from ragcache.options import QueryOptions
        assert ragcache.config.__file__.startswith(%r), ragcache.config.__file__
        settings = Settings.load(blend={"scratch_knob": 5})
        params = BlendParams.from_options(settings.blend, QueryOptions(mode="blend"), mode="blend", ctx_len=4,
                                          lead_in_len=1, segments=(SegmentRef("head", 0, 4),))
        arrived = BlendParams.from_dict(json.loads(json.dumps(params.to_dict())))  # the worker's copy
        request = BlendRequest(token_ids=torch.arange(4), positions=torch.arange(4), knobs=arrived.blend,
                               tail_ids=torch.arange(2))
        print(request.knobs.scratch_knob)
    """ % str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "5"
