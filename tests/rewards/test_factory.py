"""build_reward: every spec form builds the reward it names; misspellings fail with a one-line error."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fgrpo.rewards import build_reward
from fgrpo.rewards.client import HttpReward
from fgrpo.rewards.jpeg import JpegReward
from fgrpo.rewards.multi import MultiReward
from fgrpo.rewards.ocr import OcrReward, RapidOcrEngine
from fgrpo.rewards.vlm import VlmOcrEngine

IMAGES = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)


def test_names():
    ocr = build_reward("ocr")
    assert isinstance(ocr, OcrReward)
    assert isinstance(ocr.engine, RapidOcrEngine)
    c, i = build_reward("jpeg_compressibility"), build_reward("jpeg_incompressibility")
    np.testing.assert_allclose(c(IMAGES, ["", ""]).scores, -i(IMAGES, ["", ""]).scores)


def test_dict_options_reach_the_reward():
    r = build_reward({"name": "jpeg_incompressibility", "scale": 1.0, "quality": 50})
    assert isinstance(r, JpegReward) and (r.scale, r.quality, r.sign) == (1.0, 50, 1.0)
    v = build_reward({"name": "ocr", "engine": "vlm", "base_url": "http://127.0.0.1:1", "model": "m"})
    assert isinstance(v, OcrReward)
    assert isinstance(v.engine, VlmOcrEngine) and v.engine.url == "http://127.0.0.1:1/v1/chat/completions"
    h = build_reward({"name": "http", "url": "http://127.0.0.1:1", "batch_size": 3})
    assert isinstance(h, HttpReward) and h.batch_size == 3


def test_multi_from_list_dict_and_json_string_agree():
    members = [
        {"name": "jpeg_compressibility", "weight": 2.0},
        {"name": "jpeg_incompressibility", "weight": 0.5, "required": False, "key": "inc"},
    ]
    outs = [
        build_reward(s)(IMAGES, ["", ""])
        for s in (members, {"name": "multi", "members": members}, json.dumps(members))
    ]
    for out in outs:
        assert set(out.components) == {"jpeg_compressibility", "inc"}
        np.testing.assert_allclose(
            out.scores, 2.0 * out.components["jpeg_compressibility"] + 0.5 * out.components["inc"]
        )
        np.testing.assert_array_equal(out.scores, outs[0].scores)
    multi = build_reward(members)
    assert isinstance(multi, MultiReward)
    assert [m.required for m in multi.members] == [True, False]


def test_import_path_spec():
    r = build_reward({"name": "fgrpo.rewards.jpeg:jpeg_compressibility", "scale": 1.0})
    assert isinstance(r, JpegReward) and r.scale == 1.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ocrr", "unknown reward 'ocrr'"),
        ({"name": "jpeg_compressibility", "qualty": 90}, "qualty"),
        ({"name": "ocr", "engine": "tesseract"}, "engine must be one of"),
        ({"name": "ocr", "engine": "vlm", "base_url": "http://x"}, "model"),
        ({"name": "ocr", "text_scor": 0.1}, "text_scor"),
        ('[{"name": "ocr"', "not valid JSON"),
        ([{"weight": 1.0}], "no 'name'"),
        ([{"name": "jpeg_compressibility", "required": "yes"}], "'required' must be true or false"),
        ({"name": "nosuchmod:make"}, "cannot import"),
        (42, "reward spec must be"),
    ],
)
def test_bad_specs_fail_clearly(spec, message):
    with pytest.raises(ValueError, match=message):
        build_reward(spec)
