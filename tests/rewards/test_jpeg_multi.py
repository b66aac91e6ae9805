"""JPEG (in)compressibility against PIL's own byte count, and the multi-reward's weighted sum and its
required/optional failure handling."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from fgrpo.rewards.base import RewardOutput, concat_outputs
from fgrpo.rewards.jpeg import jpeg_compressibility, jpeg_incompressibility
from fgrpo.rewards.multi import Member, MultiReward

rng = np.random.default_rng(0)
FLAT = np.full((64, 64, 3), 128, np.uint8)
NOISE = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
IMAGES = np.stack([FLAT, NOISE])
PROMPTS = ["a", "b"]


def _jpeg_bytes(image, quality=95):
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=quality)
    return len(buf.getvalue())


def test_jpeg_rewards_are_signed_kb_over_500():
    kb = np.array([_jpeg_bytes(FLAT), _jpeg_bytes(NOISE)]) / 1000
    comp = jpeg_compressibility()(IMAGES, PROMPTS)
    incomp = jpeg_incompressibility()(IMAGES, PROMPTS)
    np.testing.assert_allclose(comp.scores, -kb / 500, rtol=1e-6)
    np.testing.assert_allclose(incomp.scores, kb / 500, rtol=1e-6)
    assert comp.scores.dtype == np.float32
    assert comp.scores[0] > comp.scores[1]  # flat grey compresses better than noise
    np.testing.assert_allclose(
        jpeg_incompressibility(scale=1.0)(IMAGES, PROMPTS).scores, kb, rtol=1e-6
    )  # DDPO


def test_jpeg_quality_is_checked():
    with pytest.raises(ValueError, match="quality"):
        jpeg_compressibility(quality=0)


class Const:
    def __init__(self, values, metrics=None):
        self.values, self.metrics = np.asarray(values, np.float32), metrics or {}

    def __call__(self, images, prompts, metadata=None):
        return RewardOutput(scores=self.values[: len(images)].copy(), metrics=dict(self.metrics))


class Boom:
    def __call__(self, images, prompts, metadata=None):
        raise ConnectionError("scorer down")


def test_multi_is_weighted_sum_with_components():
    r = MultiReward([Member("a", Const([1.0, 2.0]), 0.5), Member("b", Const([10.0, -4.0]), 2.0)])
    out = r(IMAGES, PROMPTS)
    np.testing.assert_allclose(out.scores, [0.5 + 20.0, 1.0 - 8.0])
    np.testing.assert_allclose(out.components["a"], [1.0, 2.0])
    np.testing.assert_allclose(out.components["b"], [10.0, -4.0])
    assert out.metrics["a/fail_count"] == 0 and out.metrics["b/mean"] == pytest.approx(3.0)


def test_optional_member_failure_is_excluded_and_counted_not_zeroed(caplog):
    r = MultiReward([Member("a", Const([1.0, 2.0]), 1.0), Member("b", Boom(), 3.0, required=False)])
    out = r(IMAGES, PROMPTS)
    np.testing.assert_allclose(out.scores, [1.0, 2.0])
    assert np.isnan(out.components["b"]).all()
    assert out.metrics["b/fail_count"] == 2
    assert "scorer down" in caplog.text


def test_optional_member_nan_sample_is_excluded_for_that_sample_only():
    r = MultiReward(
        [Member("a", Const([1.0, 2.0]), 1.0), Member("b", Const([np.nan, 5.0]), 2.0, required=False)]
    )
    out = r(IMAGES, PROMPTS)
    np.testing.assert_allclose(out.scores, [1.0, 12.0])
    assert out.metrics["b/fail_count"] == 1
    assert out.metrics["b/mean"] == 5.0


def test_required_member_failure_raises_with_its_name():
    r = MultiReward([Member("a", Const([1.0, 2.0])), Member("ocr", Boom(), required=True)])
    with pytest.raises(RuntimeError, match="'ocr' failed: scorer down"):
        r(IMAGES, PROMPTS)
    r = MultiReward([Member("ocr", Const([1.0, np.nan]))])
    with pytest.raises(RuntimeError, match="non-finite scores at samples \\[1\\]"):
        r(IMAGES, PROMPTS)


def test_sample_with_no_member_present_raises():
    r = MultiReward([Member("a", Const([np.nan, 1.0]), required=False), Member("b", Boom(), required=False)])
    with pytest.raises(RuntimeError, match="samples \\[0\\]"):
        r(IMAGES, PROMPTS)


def test_multi_rejects_duplicate_names_and_bad_shapes():
    with pytest.raises(ValueError, match="unique"):
        MultiReward([Member("a", Const([1.0])), Member("a", Const([1.0]))])
    r = MultiReward([Member("a", Const([1.0]))])  # returns 1 score for 2 images
    with pytest.raises(RuntimeError, match="shape"):
        r(IMAGES, PROMPTS)


def test_concat_outputs_adds_counts_and_averages_the_rest():
    a = RewardOutput(
        np.array([1, 2], np.float32), {"c": np.array([1, np.nan], np.float32)}, {"x": 1.0, "n_count": 1.0}
    )
    b = RewardOutput(np.array([3], np.float32), {"c": np.array([3], np.float32)}, {"x": 4.0, "n_count": 2.0})
    out = concat_outputs([a, b])
    np.testing.assert_array_equal(out.scores, [1, 2, 3])
    np.testing.assert_array_equal(out.components["c"], [1, np.nan, 3])
    assert out.metrics == {"x": pytest.approx((2 * 1.0 + 4.0) / 3), "n_count": 3.0}
