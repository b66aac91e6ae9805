"""OCR reward: target extraction, the score formula (closed forms, an independent edit-distance reference,
invariances), the reward glue with a fake engine, and real PP-OCR on text rendered with DejaVu Sans."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fgrpo.rewards.ocr import EXACT_MIN_SCORE, OcrReward, extract_target, is_exact, ocr_score

from .helpers import render_text


def test_extract_target_takes_first_quoted_span():
    assert extract_target('a neon sign that says "Open 24h" above a "door"') == "Open 24h"
    assert extract_target('"FLOW"') == "FLOW"


@pytest.mark.parametrize("prompt", ["no quotes at all", 'one "quote only', 'blank "  " target'])
def test_extract_target_rejects_prompt_without_target(prompt):
    with pytest.raises(ValueError, match="quote") as e:
        extract_target(prompt)
    assert repr(prompt) in str(e.value)  # the error names the prompt


@pytest.mark.parametrize(
    ("recognized", "target", "expected"),
    [
        ("HELLO WORLD", "hello world", 1.0),  # case and spaces do not matter
        ("hello\nworld", "hello world", 1.0),  # neither do newlines (flow_grpo strips only ' ')
        ("big SALE today", "sale", 1.0),  # substring: text around the target is free
        ("hellp", "hello", 0.8),  # one substitution out of 5
        ("helo", "hello", 0.8),  # one deletion
        ("", "hello", 0.0),  # nothing recognized
        ("completely unrelated and much longer", "abc", 0.0),  # distance capped at len(target)
        ("ab", "abcd", 0.5),  # two insertions needed
    ],
)
def test_ocr_score_closed_forms(recognized, target, expected):
    assert ocr_score(recognized, target) == pytest.approx(expected)


def test_ocr_score_rejects_blank_target():
    with pytest.raises(ValueError, match="empty"):
        ocr_score("anything", " \t")


def _levenshtein(a: str, b: str) -> int:
    """Textbook DP, only as an independent reference for the library call."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


text = st.text(alphabet="abcAB \n", max_size=12)
target = st.text(alphabet="abcAB ", min_size=1, max_size=8).filter(lambda s: s.strip())


@settings(max_examples=300, deadline=None)
@given(text, target)
def test_ocr_score_matches_reference_definition(recognized, tgt):
    r, t = "".join(recognized.split()).lower(), "".join(tgt.split()).lower()
    d = 0 if t in r else _levenshtein(r, t)
    assert ocr_score(recognized, tgt) == pytest.approx(1 - min(d, len(t)) / len(t))


@settings(max_examples=200, deadline=None)
@given(text, target, st.integers(0, 12))
def test_ocr_score_invariances(recognized, tgt, pos):
    s = ocr_score(recognized, tgt)
    assert 0.0 <= s <= 1.0
    assert ocr_score(recognized.upper(), tgt.lower()) == s
    assert ocr_score(recognized[:pos] + " \n" + recognized[pos:], tgt) == s
    assert ocr_score("xx" + tgt + "yy", tgt) == 1.0


@settings(max_examples=200, deadline=None)
@given(text, target)
def test_is_exact_means_the_target_is_read_letter_for_letter(recognized, tgt):
    r, t = "".join(recognized.split()).lower(), "".join(tgt.split()).lower()
    score = ocr_score(recognized, tgt)
    assert is_exact(score) == (t in r)
    assert is_exact(np.float32(score)) == (t in r)  # the reward's dtype


def test_is_exact_keeps_its_kind_and_the_nearest_miss_out():
    import torch

    long = "a" * 999_999  # one letter missing: 1 - 1/n, the closest a non-exact read gets below 1
    assert not is_exact(ocr_score(long[1:], long)) and is_exact(ocr_score(long, long))
    scores = [1.0, 1.0 - 1e-7, 0.999, 0.0]  # 1 - 1e-7: a 1 after float rounding
    np.testing.assert_array_equal(is_exact(np.array(scores, np.float32)), [True, True, False, False])
    assert is_exact(torch.tensor(scores)).tolist() == [True, True, False, False]
    assert EXACT_MIN_SCORE < 1.0


class FakeEngine:
    def __init__(self, texts):
        self.texts, self.calls = texts, 0

    def recognize(self, images):
        self.calls += 1
        return self.texts[: len(images)]


def test_ocr_reward_scores_each_image_against_its_prompt():
    engine = FakeEngine(["OPEN", "CLOSD", ""])
    images = np.zeros((3, 8, 8, 3), np.uint8)
    out = OcrReward(engine)(images, ['sign "open"', 'sign "closed"', 'sign "x"'])
    np.testing.assert_allclose(out.scores, [1.0, 5 / 6, 0.0], rtol=1e-6)
    assert out.scores.dtype == np.float32
    assert out.metrics["ocr/exact"] == pytest.approx(1 / 3)
    # the collapse guard's gold statistic: which images the reader found no text in
    assert out.components["no_text"].tolist() == [0.0, 0.0, 1.0]


def test_ocr_reward_fails_on_bad_prompt_before_running_ocr():
    engine = FakeEngine(["a", "b"])
    with pytest.raises(ValueError, match="no text between double quotes"):
        OcrReward(engine)(np.zeros((2, 8, 8, 3), np.uint8), ['ok "a"', "missing quotes"])
    assert engine.calls == 0


def test_ocr_reward_refuses_videos_naming_the_video_reward():
    engine = FakeEngine(["a"])
    with pytest.raises(ValueError, match="video_ocr"):
        OcrReward(engine)(np.zeros((1, 2, 8, 8, 3), np.uint8), ['"a"'])
    assert engine.calls == 0


def test_ocr_reward_rejects_non_uint8_images():
    with pytest.raises(TypeError, match="uint8"):
        OcrReward(FakeEngine(["a"]))(np.zeros((1, 8, 8, 3), np.float32), ['"a"'])


def test_rapidocr_on_rendered_text(font_path, rapid_engine):
    """Real PP-OCR at 512²: exact text ≈ 1, a misspelling costs about its edit distance, blank scores 0."""
    target = "HELLO WORLD"  # 10 characters once the space is removed
    misspelt = "HELO WORD"  # two deletions -> ideal score 0.8
    images = np.stack(
        [
            render_text(target, font_path),
            render_text(misspelt, font_path),
            np.full((512, 512, 3), 255, np.uint8),
        ]
    )
    prompt = f'a poster that says "{target}"'
    out = OcrReward(rapid_engine)(images, [prompt] * 3)
    exact, wrong, blank = out.scores.tolist()
    assert exact == pytest.approx(1.0)
    assert abs(wrong - 0.8) <= 0.1 + 1e-6, wrong  # one OCR slip of slack on top of the 2 edits
    assert blank == 0.0


def test_rapidocr_engine_feeds_bgr_and_joins_lines():
    """rapidocr reads numpy input as OpenCV BGR; our images are RGB, so the engine must flip channels."""
    from fgrpo.rewards.ocr import RapidOcrEngine

    seen = []

    class Result:
        def __init__(self, txts):
            self.txts = txts

    engine = RapidOcrEngine()  # cheap: rapidocr loads its models on first use
    engine._engine = lambda arr: seen.append(arr) or Result(("NEW", "YORK") if len(seen) == 1 else None)  # pyright: ignore[reportAttributeAccessIssue] - a stand-in for rapidocr's engine
    rgb = np.random.default_rng(0).integers(0, 256, (2, 4, 5, 3), dtype=np.uint8)
    assert engine.recognize(rgb) == ["NEW YORK", ""]
    np.testing.assert_array_equal(seen[0], rgb[0][..., ::-1])


def test_rapidocr_engine_raises_when_the_recognizer_failed():
    """rapidocr logs a recognizer error and returns the detector's output (boxes, no text): that is a failed
    read, not an empty one, so it must raise rather than score the image 0."""
    from rapidocr.ch_ppocr_det import TextDetOutput

    from fgrpo.rewards.ocr import RapidOcrEngine

    engine = RapidOcrEngine()
    engine._engine = lambda arr: TextDetOutput(boxes=np.zeros((1, 4, 2)), scores=[0.9])  # pyright: ignore[reportAttributeAccessIssue] - a stand-in for rapidocr's engine
    with pytest.raises(RuntimeError, match="recognizer failed on image 0"):
        engine.recognize(np.zeros((1, 4, 5, 3), dtype=np.uint8))


def test_rapidocr_detector_sizing_options():
    from fgrpo.rewards.ocr import RapidOcrEngine

    def det(engine):
        return engine._engine.cfg.Det.limit_type, engine._engine.cfg.Det.limit_side_len

    assert det(RapidOcrEngine()) == ("max", 960)  # PaddleOCR's default, as flow_grpo ran it
    assert det(RapidOcrEngine(det_min_side_len=64)) == ("min", 64)
    assert det(RapidOcrEngine(det_limit_side_len=64)) == ("min", 64)  # the first version's name still works
    with pytest.raises(ValueError, match="not both"):
        RapidOcrEngine(det_min_side_len=64, det_limit_side_len=64)


def test_rapidocr_reads_tiny_images_at_native_size(font_path, rapid_engine):
    """The tiny training preset renders 32x128 images: the default sizing must read them without upscaling."""
    words = ["CAFE", "EXIT"]
    images = np.stack(
        [render_text(w, font_path, size=128, font_size=20)[48:80] for w in words]
    )  # [2, 32, 128, 3]
    assert images.shape == (2, 32, 128, 3)
    out = OcrReward(rapid_engine)(images, [f'"{w}"' for w in words])
    np.testing.assert_array_equal(out.scores, [1.0, 1.0])


# Held-out words of the text renderer, the longest (8 letters) filling most of a 32x128 canvas as it draws them.
RENDERER_WORDS = ["AGENCY", "ANTIQUE", "ALPHA", "BANNERS", "CAPTURES", "DELIVERY", "EXIT", "CAFE"]


@pytest.fixture(scope="module")
def rec_only_engine():
    """A recognizer-only engine, loaded with rapidocr's downloads made to fail (it too runs offline)."""
    from rapidocr.utils.download_file import DownloadFile

    from fgrpo.rewards.ocr import RapidOcrEngine

    def no_download(*args, **kwargs):
        raise AssertionError("rapidocr tried to download a file; fgrpo must run it offline")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DownloadFile, "run", no_download)
        engine = RapidOcrEngine(detect=False, num_threads=1)
        engine.recognize(np.full((1, 32, 128, 3), 255, np.uint8))  # loads the recognizer
    return engine


def test_rapidocr_recognizer_only_reads_rendered_words_like_the_full_pipeline(
    font_path, rapid_engine, rec_only_engine
):
    """Dark-on-light words at 32x128, as the text renderer draws them: recognition alone reads each word
    letter for letter, as detection + recognition does, and never loads the detector."""
    images = np.stack(
        [
            render_text(w, font_path, size=128, font_size=18 if len(w) > 6 else 22)[48:80]
            for w in RENDERER_WORDS
        ]
    )  # [8, 32, 128, 3]
    assert rec_only_engine.recognize(images) == RENDERER_WORDS
    assert rapid_engine.recognize(images) == RENDERER_WORDS
    assert rec_only_engine._engine.text_det is None
    assert rec_only_engine.recognize(np.full((1, 32, 128, 3), 255, np.uint8)) == [""]


def test_rapidocr_recognizer_only_keeps_the_confidence_filter_and_flags_failures():
    """Without the detector rapidocr returns the recognizer's raw line: the engine applies text_score itself
    (PaddleOCR's drop_score, kept at >=) and raises when rapidocr returns no line at all (a failed read)."""
    from rapidocr.ch_ppocr_rec import TextRecOutput
    from rapidocr.utils.output import RapidOCROutput

    from fgrpo.rewards.ocr import RapidOcrEngine

    engine = RapidOcrEngine(detect=False, text_score=0.5)
    seen, scores = [], iter([0.5, 0.49])
    # rapidocr's recognizer itself passes scores as a tuple (TextRecOutput declares a list)
    engine._engine = lambda arr: seen.append(arr) or TextRecOutput(txts=("ABC",), scores=(next(scores),))  # pyright: ignore[reportAttributeAccessIssue, reportArgumentType] - a stand-in for rapidocr's engine
    rgb = np.random.default_rng(0).integers(0, 256, (2, 4, 5, 3), dtype=np.uint8)
    assert engine.recognize(rgb) == ["ABC", ""]
    np.testing.assert_array_equal(seen[1], rgb[1][..., ::-1])  # BGR, as on the detector path
    engine._engine = lambda arr: RapidOCROutput()  # pyright: ignore[reportAttributeAccessIssue] - a stand-in for rapidocr's engine
    with pytest.raises(RuntimeError, match="recognizer failed on image 0"):
        engine.recognize(rgb)


def test_rapidocr_detect_option_from_a_spec():
    """ "detect": false reaches the engine through a reward spec; the default keeps the detector; a value that
    is not a JSON bool, or a detector size beside detect=False, is a one-line error naming the key."""
    from fgrpo.rewards import build_reward
    from fgrpo.rewards.ocr import RapidOcrEngine

    assert RapidOcrEngine()._engine.use_det is True
    reward = build_reward('{"name": "ocr", "num_threads": 1, "detect": false}')
    assert isinstance(reward, OcrReward) and isinstance(reward.engine, RapidOcrEngine)
    engine = reward.engine
    assert engine._engine.use_det is False and engine.detect is False
    with pytest.raises(ValueError, match="detect must be true or false, got 'false'"):
        build_reward('{"name": "ocr", "detect": "false"}')
    with pytest.raises(ValueError, match="detect=False skips"):
        RapidOcrEngine(detect=False, det_limit_side_len=64)


@pytest.fixture(scope="module")
def torch_rec_engine():
    """The recognizer alone as a torch module on the CPU (the GPU path's code, CPU arithmetic)."""
    from fgrpo.rewards.ocr import RapidOcrEngine

    return RapidOcrEngine(detect=False, device="cpu", batch_size=5)


def _renderer_like_words(font_path) -> np.ndarray:
    """The renderer's held-out words at 32x128, then the same words under heavy pixel noise (reads with lower
    confidence, some below text_score), then pure noise (nothing to read): [20, 32, 128, 3]."""
    clean = np.stack(
        [
            render_text(w, font_path, size=128, font_size=18 if len(w) > 6 else 22)[48:80]
            for w in RENDERER_WORDS
        ]
    )
    rng = np.random.default_rng(0)
    noisy = np.clip(clean.astype(np.int64) + rng.integers(-120, 120, clean.shape), 0, 255).astype(np.uint8)
    return np.concatenate([clean, noisy, rng.integers(0, 256, (4, 32, 128, 3), dtype=np.uint8)])


def test_torch_recognizer_module_matches_onnxruntime():
    """The converted graph computes what onnxruntime computes from the same ONNX file: the [B, T, classes]
    probabilities agree within fp32 rounding at two input widths (the padded widths of 32x128 and 32x400 lines)."""
    import onnxruntime as ort
    import torch

    from fgrpo.rewards.ocr import _RAPIDOCR_MODELS, TorchRecognizer

    path = _rapidocr_model_dir() / _RAPIDOCR_MODELS["Rec"]
    module = TorchRecognizer(path, "cpu").module
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for width in (320, 600):
        x = rng.uniform(-1, 1, (3, 3, 48, width)).astype(np.float32)
        ref = np.asarray(session.run(None, {"x": x})[0])
        with torch.no_grad():
            got = module(torch.from_numpy(x)).numpy()
        assert got.shape == ref.shape and ref.shape[2] > 18000  # [3, T, ~18.7k classes]
        np.testing.assert_allclose(got, ref, atol=1e-4)
        assert (got.argmax(-1) == ref.argmax(-1)).all()


def _rapidocr_model_dir():
    from pathlib import Path

    import rapidocr

    return Path(rapidocr.__file__).parent / "models"


def test_torch_recognizer_reads_as_rapidocr_reads_each_image_alone(
    font_path, rec_only_engine, torch_rec_engine
):
    """Batched (5 a forward) on the torch module, every image reads the text onnxruntime reads when rapidocr
    is called on that image alone, with the confidence within 1e-4: clean words, noisy words, noise; a word
    drawn 32x400 (a wider padded input) in the same call reads as alone; text_score filters as before."""
    images = _renderer_like_words(font_path)
    assert torch_rec_engine.recognize(images) == rec_only_engine.recognize(images)
    assert torch_rec_engine.recognize(images)[: len(RENDERER_WORDS)] == RENDERER_WORDS

    def raw(engine, ims):  # (text, confidence) before the text_score filter
        e = engine._engine
        lines = [e.preprocess_img(e.load_img(np.ascontiguousarray(im[..., ::-1])))[0] for im in ims]
        if engine._torch_rec is not None:
            return engine._torch_rec(lines, e)
        return [(r.txts[0], r.scores[0]) for r in (e(line) for line in lines)]

    wide = render_text("DELIVERY TRUCKS", font_path, size=400, font_size=40)[180:212]  # [32, 400, 3]
    mixed = [images[0], wide, images[9], images[-1]]
    ort_lines, torch_lines = raw(rec_only_engine, mixed), raw(torch_rec_engine, mixed)
    assert [t for t, _ in torch_lines] == [t for t, _ in ort_lines]
    np.testing.assert_allclose([s for _, s in torch_lines], [s for _, s in ort_lines], atol=1e-4)
    assert torch_lines[1][0].replace(" ", "") == "DELIVERYTRUCKS"
    low = [s for _, s in raw(rec_only_engine, images[8:])]
    assert min(low) < 0.5 < max(low)  # the noisy words straddle text_score, so the filter is exercised


def test_torch_recognizer_options_are_checked_and_reach_it_from_a_spec():
    from fgrpo.rewards import build_reward
    from fgrpo.rewards.ocr import RapidOcrEngine, TorchRecognizer

    reward = build_reward('{"name": "ocr", "detect": false, "device": "cpu", "batch_size": 64}')
    assert isinstance(reward, OcrReward) and isinstance(reward.engine, RapidOcrEngine)
    rec = reward.engine._torch_rec
    assert isinstance(rec, TorchRecognizer) and rec.batch_size == 64 and rec.device.type == "cpu"
    assert RapidOcrEngine(detect=False)._torch_rec is None
    with pytest.raises(ValueError, match="runs the recognizer alone; set detect false"):
        RapidOcrEngine(device="cpu")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        RapidOcrEngine(detect=False, device="cpu", batch_size=0)
