"""OCR reward (the main experiment's task): does the image spell the quoted text of its prompt?

reward = 1 - min(d, n) / n, where n = len(target) and d = 0 if the target is a substring of the recognized
text, else the Levenshtein distance between the two (both lower-cased, all whitespace removed).

Engines turn images into recognized text; they are interchangeable behind `OcrEngine`:
- `RapidOcrEngine`: PP-OCR through rapidocr + onnxruntime on CPU, weights from rapidocr's wheel (default); with
  `device`, its recognizer alone runs as a torch module on that device (`TorchRecognizer`);
- `fgrpo.rewards.vlm.VlmOcrEngine` / `VllmOcrEngine`: a VLM transcriber through vLLM.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from rapidfuzz.distance import Levenshtein

from fgrpo.rewards.base import RewardOutput, check_inputs


def extract_target(prompt: str) -> str:
    """The text between the first pair of double quotes of `prompt` (the text the image must show).

    Raises:
        ValueError naming the prompt when it has no quoted text or the quoted text is blank.
    """
    parts = prompt.split('"')
    if len(parts) < 3:
        raise ValueError(
            f'OCR prompt has no text between double quotes: {prompt!r}; write it like: a sign that says "OPEN"'
        )
    target = parts[1]
    if not target.strip():
        raise ValueError(
            f"OCR prompt quotes only whitespace: {prompt!r}; put the text to render between the quotes"
        )
    return target


def _normalize(text: str) -> str:
    return "".join(text.split()).lower()


def ocr_score(recognized: str, target: str) -> float:
    """flow_grpo's OCR reward for one image: 1 - min(d, n) / n in [0, 1].

    Both strings are lower-cased with all whitespace removed; d = 0 when the target is a substring of the
    recognized text (extra text around it is not penalised), else d = Levenshtein(recognized, target);
    n = len(target). Capping d at n makes a page of unrelated text cost no more than recognizing nothing.

    Differs from flow_grpo: it strips only the ASCII space; we strip all whitespace (newlines, tabs), so a
    target split over two lines by the model still counts as spelt correctly.
    """
    recognized, target = _normalize(recognized), _normalize(target)
    if not target:
        raise ValueError(
            "ocr_score target is empty after removing whitespace; the prompt must quote some text"
        )
    d = 0 if target in recognized else Levenshtein.distance(recognized, target)
    return 1.0 - min(d, len(target)) / len(target)


# `ocr_score` is exactly 1 when the target is read letter for letter (d = 0) and at most 1 - 1/n otherwise;
# the margin absorbs float rounding of a score carried through float32, a weighted sum or the wire, and
# stays above 1 - 1/n for any target shorter than a million characters.
EXACT_MIN_SCORE = 1.0 - 1e-6


def is_exact(scores):
    """Whether OCR scores mean an exact read (the target found letter for letter, d = 0 in `ocr_score`).

    Args:
        scores: a float, numpy array or torch tensor of `ocr_score` values.
    Returns:
        bool of the same kind and shape (`.mean()` of it is the exact-read fraction).
    """
    return scores >= EXACT_MIN_SCORE


class OcrEngine(Protocol):
    def recognize(self, images: np.ndarray) -> list[str]:
        """uint8 RGB images [B, H, W, 3] -> the text recognized in each (empty string when none)."""
        ...


# The PP-OCR models shipped inside the rapidocr wheel. We pass their paths explicitly: with model_path unset
# rapidocr checks a checksum and would try to download a missing or different file; we never download.
_RAPIDOCR_MODELS = {
    "Det": "PP-OCRv6_det_small.onnx",
    "Rec": "PP-OCRv6_rec_small.onnx",
    "Cls": "ch_ppocr_mobile_v2.0_cls_mobile.onnx",
}


class RapidOcrEngine:
    """PP-OCR (detection + recognition, or recognition only) via rapidocr, onnxruntime on CPU; offline, quiet.

    Args:
        text_score: lines recognized with lower confidence are dropped (PaddleOCR's drop_score, which
            flow_grpo's PaddleOCR call uses at its default 0.5).
        num_threads: onnxruntime intra-op threads; None = all cores. Set it when scoring overlaps a rollout
            so OCR does not starve the data loader.
        det_max_side_len: the detector shrinks an image whose long side exceeds this and leaves smaller
            ones at native size: PaddleOCR's default (max/960), so flow_grpo's detector saw 512² images as is.
            rapidocr's own default (enlarge until the short side is 736) made a 512² image cost ~1.6x the CPU
            and a 32x128 one ~37x, for the same recognized text on our renderings (benchmarks/RESULTS.md).
        det_min_side_len: if set, use rapidocr's other mode instead: enlarge an image whose short side is below
            this. `det_limit_side_len` is its old name (this class's first version), kept so callers work.
        params: extra rapidocr config overrides, e.g. {"Det.box_thresh": 0.4}.
        detect: False skips the detector and reads the whole image as one line with the recognizer (rapidocr's
            `Global.use_det=False`), dropping the line when its confidence is below `text_score`. Valid only
            when each image is one line of text filling it, as the bundled text renderer draws (32x128, one
            word): the recognizer squeezes any image to 48 px high, so a page or a small word on a large
            canvas reads as noise. On 256 held-out words of that renderer (10 ODE steps; one onnxruntime
            thread) it took 19 ms an image instead of 27; the mean score moved by 0.011 without CFG (0.621 vs
            0.632) and 0.0003 with CFG 3 (0.802); the mean |score difference| per image was 0.044 / 0.030,
            against 0.017 / 0.011 for the detector path reading the same images moved by one pixel. Real
            renders of the words read exactly either way. Images are read one call each: batching the
            recognizer was no faster on one thread (64 a call: 30 % slower).
        device: with detect=False, run the recognizer as a torch module on this device ("cuda", "cuda:1",
            "cpu"), `batch_size` images a forward (`TorchRecognizer`: the same ONNX weights, rapidocr's own
            resizing and CTC decoding); None = onnxruntime on the CPU, one image a call.

    Differs from flow_grpo: PP-OCRv6 small via onnxruntime instead of PaddleOCR's PP-OCR (en); like flow_grpo
    the angle classifier is off (generated text is upright).
    """

    def __init__(
        self,
        *,
        text_score: float = 0.5,
        num_threads: int | None = None,
        det_max_side_len: int = 960,
        det_min_side_len: int | None = None,
        det_limit_side_len: int | None = None,
        params: dict[str, Any] | None = None,
        detect: bool = True,
        device: str | None = None,
        batch_size: int = 256,
    ):
        import rapidocr

        if not isinstance(detect, bool):
            raise ValueError(f"OCR engine option detect must be true or false, got {detect!r}")
        if device is not None and detect:
            raise ValueError(
                f"OCR engine option device={device!r} runs the recognizer alone; set detect false (the detector "
                "stays an onnxruntime model on the CPU)"
            )
        model_dir = Path(rapidocr.__file__).parent / "models"
        if det_limit_side_len is not None:
            if det_min_side_len is not None:
                raise ValueError("pass det_min_side_len or its old name det_limit_side_len, not both")
            det_min_side_len = det_limit_side_len
        if not detect and det_min_side_len is not None:
            raise ValueError(
                "det_min_side_len (det_limit_side_len) sizes the detector, which detect=False skips"
            )
        self.detect = detect
        cfg: dict[str, Any] = {
            "Global.use_det": detect,
            "Global.use_cls": False,
            "Global.text_score": float(text_score),
            "Global.log_level": "error",  # "info" logs every model load, "warning" every blank image
            "Det.limit_type": "max" if det_min_side_len is None else "min",
            "Det.limit_side_len": int(det_max_side_len if det_min_side_len is None else det_min_side_len),
        }
        for task, fname in _RAPIDOCR_MODELS.items():
            path = model_dir / fname
            if not path.is_file():
                raise FileNotFoundError(
                    f"rapidocr model {path} is missing; reinstall the rapidocr wheel (uv sync --reinstall-package "
                    f"rapidocr) — fgrpo never downloads OCR weights"
                )
            cfg[f"{task}.model_path"] = str(path)
        if num_threads is not None:
            cfg["EngineConfig.onnxruntime.intra_op_num_threads"] = int(num_threads)
            cfg["EngineConfig.onnxruntime.inter_op_num_threads"] = 1
        cfg.update(params or {})
        self._engine = rapidocr.RapidOCR(params=cfg)
        self._text_score = self._engine.text_score  # what rapidocr's own filter reads (params may set it)
        self._torch_rec = (
            None
            if device is None
            else TorchRecognizer(model_dir / _RAPIDOCR_MODELS["Rec"], device, batch_size=batch_size)
        )

    def recognize(self, images: np.ndarray) -> list[str]:
        from rapidocr.ch_ppocr_cls import TextClsOutput
        from rapidocr.ch_ppocr_det import TextDetOutput

        if self._torch_rec is not None:
            # rapidocr's own input path (its image loader and size bounds), then every image in batches
            engine = self._engine
            lines = [
                engine.preprocess_img(engine.load_img(np.ascontiguousarray(im[..., ::-1])))[0]
                for im in images
            ]
            return [t if s >= self._text_score else "" for t, s in self._torch_rec(lines, engine)]
        texts = []
        for i, image in enumerate(images):
            # rapidocr reads a numpy array as OpenCV BGR; ours are RGB.
            result = self._engine(np.ascontiguousarray(image[..., ::-1]))
            if not self.detect:
                texts.append(self._one_line(result, i))
                continue
            # A failed recognizer is logged by rapidocr, which then returns an earlier stage's output.
            if isinstance(result, TextDetOutput | TextClsOutput):
                raise RuntimeError(
                    f"rapidocr's recognizer failed on image {i} (it returned a {type(result).__name__}); rerun with "
                    "params={'Global.log_level': 'warning'} to see rapidocr's reason"
                )
            lines = result.txts or ()
            texts.append(" ".join(lines))
        return texts

    def _one_line(self, result: Any, i: int) -> str:
        """Image i's line as the recognizer reads it, or "" below `text_score` (the detector path's filter)."""
        from rapidocr.ch_ppocr_rec import TextRecOutput

        # Without the detector rapidocr returns the recognizer's output, or an empty result when it failed.
        if not isinstance(result, TextRecOutput) or result.txts is None:
            raise RuntimeError(
                f"rapidocr's recognizer failed on image {i} (it returned a {type(result).__name__} without "
                "text); rerun with params={'Global.log_level': 'warning'} to see rapidocr's reason"
            )
        (text,), (score,) = result.txts, result.scores
        return text if score >= self._text_score else ""


class TorchRecognizer:
    """rapidocr's PP-OCR recognizer as a torch module on any device, batched: onnxruntime's CPU kernels read one
    image in ~19 ms; a GPU reads hundreds in one forward.

    The module is the recognizer's ONNX graph converted by onnx2torch (the same weights; its three
    "SAME_UPPER" pads, which onnx2torch does not convert, written out as the explicit pads they mean for a
    stride-1 2x2 window). Inputs are resized and normalised by rapidocr's own `resize_norm_img` and the output
    decoded by its own CTC decoder, so only the convolutions' arithmetic differs from onnxruntime's: fp32, TF32
    off (probabilities within ~1e-5 of onnxruntime's on the CPU; tests/rewards/test_ocr.py). Images are batched
    by the width rapidocr pads each one to when it reads it alone, so no image sees more padding than in its own
    call; the arg-max over the ~18.7k classes is taken on the device and only [B, T] indices and probabilities
    come back.

    Args:
        onnx_path: the recognizer's ONNX file (rapidocr's wheel ships it).
        device: where the module runs.
        batch_size: images per forward (the [B, T, classes] probabilities of 256 images of 32x128 take 0.8 GB).
    """

    def __init__(self, onnx_path: Path, device: str, *, batch_size: int = 256):
        import onnx
        import torch
        from onnx import helper
        from onnx2torch import convert

        if batch_size < 1:
            raise ValueError(f"OCR engine option batch_size must be >= 1, got {batch_size}")
        graph = onnx.load(str(onnx_path))
        for node in graph.graph.node:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            pad = attrs.get("auto_pad", b"NOTSET")
            if pad in (b"NOTSET", b"VALID"):
                continue
            if (
                pad != b"SAME_UPPER"
                or attrs.get("strides", [1, 1]) != [1, 1]
                or attrs["kernel_shape"] != [2, 2]
            ):
                raise ValueError(
                    f"{onnx_path.name}: node {node.name} pads {pad!r} in a way TorchRecognizer does not convert"
                )
            kept = [a for a in node.attribute if a.name != "auto_pad"]
            del node.attribute[:]
            # SAME_UPPER for a 2-wide window at stride 1: one row and one column of padding, at the end
            node.attribute.extend([*kept, helper.make_attribute("pads", [0, 0, 1, 1])])
        self.device = torch.device(device)
        self.module = convert(graph).eval().to(self.device)
        self.batch_size = batch_size

    def __call__(self, images: list[np.ndarray], engine: Any) -> list[tuple[str, float]]:
        """BGR uint8 images (each [h, w, 3], any size) -> (text, confidence) each, as rapidocr's recognizer
        returns them (`engine`: the rapidocr.RapidOCR whose recognizer's resizing and decoder are used)."""
        import torch

        rec = engine.text_rec or engine._load_rec_model()
        _, height, width = rec.rec_image_shape[:3]
        ratios = [max(width / height, im.shape[1] / im.shape[0]) for im in images]
        out: list[tuple[str, float]] = [("", 0.0)] * len(images)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(ratios):  # the padded width of image i read alone
            groups.setdefault(int(height * r), []).append(i)
        for idx in groups.values():
            for start in range(0, len(idx), self.batch_size):
                rows = idx[start : start + self.batch_size]
                ratio = ratios[rows[0]]
                x = np.stack([rec.resize_norm_img(images[i], ratio) for i in rows])
                with (
                    torch.no_grad(),
                    torch.backends.cudnn.flags(enabled=True, allow_tf32=False),
                    _no_tf32_matmul(),
                ):
                    prob, index = self.module(torch.from_numpy(x).to(self.device)).float().max(dim=2)
                lines, _ = rec.postprocess_op.decode(
                    index.cpu().numpy(),
                    prob.cpu().numpy(),
                    False,
                    [ratios[i] for i in rows],
                    ratio,
                    remove_duplicate=True,
                )
                for i, line in zip(rows, lines):
                    out[i] = (line[0], float(line[1]))
        return out


@contextlib.contextmanager
def _no_tf32_matmul() -> Iterator[None]:
    """fp32 matmuls at full precision inside (a trainer may allow TF32 globally)."""
    import torch

    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


class OcrReward:
    """Reward = ocr_score(engine's text, quoted target of the prompt), per image.

    Targets are extracted before the engine runs, so a prompt without quotes fails before any OCR work.
    Metrics: `ocr/exact` fraction of exact reads (`is_exact`), `ocr/time_per_image_s`. Component `no_text`: 1.0
    for each image in which the engine read nothing.
    """

    def __init__(self, engine: OcrEngine | None = None):
        self.engine = engine if engine is not None else RapidOcrEngine()

    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardOutput:
        check_inputs(images, prompts, metadata)
        if images.ndim != 4:
            raise ValueError(
                f"the ocr reward reads images [B, H, W, 3], got videos {list(images.shape)}; use --reward.name "
                "video_ocr (OCR of sampled frames)"
            )
        targets = [extract_target(p) for p in prompts]
        t0 = time.perf_counter()
        texts = self.engine.recognize(images)
        if len(texts) != len(images):
            raise RuntimeError(f"OCR engine returned {len(texts)} texts for {len(images)} images")
        dt = time.perf_counter() - t0
        scores = np.array([ocr_score(t, g) for t, g in zip(texts, targets)], dtype=np.float32)
        metrics = {
            "ocr/exact": float(np.mean(is_exact(scores))) if len(scores) else 0.0,
            "ocr/time_per_image_s": dt / max(len(images), 1),
        }
        # which images the reader found no text in at all: a gold statistic of the collapse guard (fgrpo.guard)
        no_text = np.array([not t.strip() for t in texts], dtype=np.float32)
        return RewardOutput(scores=scores, components={"no_text": no_text}, metrics=metrics)
