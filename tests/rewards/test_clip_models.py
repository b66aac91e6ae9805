"""The CLIP-based rewards (CLIP score, PickScore, HPSv2, LAION aesthetic) on tiny random models of their real
architectures, built offline (fgrpo.rewards.random_clip), each against an oracle computed without the reward's
code: the model's own forward (transformers' logits_per_image, open_clip's normalised features) on pixels
normalised by hand, or the aesthetic head collapsed to its affine map. Images are 32x32, the tiny towers' input
size, so the resize is the identity and the by-hand pixels are exactly CLIP's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from fgrpo.errors import ConfigError
from fgrpo.rewards import build_reward
from fgrpo.rewards.aesthetic import HIDDEN, AestheticHead
from fgrpo.rewards.client import HttpReward
from fgrpo.rewards.random_clip import TINY_OPEN_CLIP, random_clip, random_open_clip, write_random_clip
from fgrpo.rewards.serve import make_app

from .helpers import serve_in_thread

rng = np.random.default_rng(0)
IMAGES = rng.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
PROMPTS = ["a red square", "a photo of a cat", "a red square", "hello world sign", "a blue circle", "a dog"]
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073])
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711])
LOGIT_SCALE = float(np.log(50.0))  # PickScore_v1's is log(100); any value tests the factor


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test here may reach the hub: a hub id that is not cached fails at once instead of retrying for a
    minute."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def by_hand_pixels(images: np.ndarray) -> torch.Tensor:
    """CLIP's normalisation of images already at the model's size: (x / 255 - mean) / std -> [B, 3, H, W]."""
    x = (images / 255.0 - CLIP_MEAN) / CLIP_STD
    return torch.from_numpy(x).permute(0, 3, 1, 2).float()


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return str(write_random_clip(tmp_path_factory.mktemp("clip"), "tiny", logit_scale=LOGIT_SCALE))


@pytest.fixture(scope="module")
def logits(clip_dir):
    """transformers' own logits_per_image (exp(logit_scale) * cos) of every image against every prompt."""
    model, processor = random_clip("tiny", "cpu", logit_scale=LOGIT_SCALE)
    tokens = processor.tokenizer(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(pixel_values=by_hand_pixels(IMAGES), **tokens)
    return out.logits_per_image.numpy()  # [images, prompts]


@pytest.fixture(scope="module")
def head_file(tmp_path_factory):
    """A state dict written with the published predictor's key names and widths (not AestheticHead's), on the
    tiny model's 16-wide embeddings."""
    gen = torch.Generator().manual_seed(1)
    widths = (16, *HIDDEN, 1)
    state = {}
    for index, (a, b) in zip((0, 2, 4, 6, 7), zip(widths[:-1], widths[1:])):
        state[f"layers.{index}.weight"] = torch.randn(b, a, generator=gen) / a**0.5
        state[f"layers.{index}.bias"] = torch.randn(b, generator=gen)
    path = tmp_path_factory.mktemp("aesthetic") / "head.pth"
    torch.save(state, path)
    return str(path), state


def test_pickscore_is_logit_scale_times_cosine(clip_dir, logits):
    out = build_reward({"name": "pickscore", "model": clip_dir, "processor": None, "device": "cpu"})(
        IMAGES, PROMPTS
    )
    np.testing.assert_allclose(out.scores, np.diag(logits), rtol=1e-4, atol=1e-4)
    assert out.scores.dtype == np.float32
    assert np.all(np.abs(out.scores) <= 50.0)  # the documented range [-exp(logit_scale), exp(logit_scale)]


def test_clip_score_is_weight_times_positive_cosine(clip_dir, logits):
    cos = np.diag(logits) / 50.0
    assert (cos < 0).any() and (cos > 0).any()  # both branches of max(cos, 0) are exercised
    out = build_reward({"name": "clip_score", "model": clip_dir, "device": "cpu"})(IMAGES, PROMPTS)
    np.testing.assert_allclose(out.scores, 2.5 * np.maximum(cos, 0), atol=1e-6)
    assert np.all(out.scores[cos < 0] == 0) and np.all((out.scores >= 0) & (out.scores <= 2.5))
    hundred = build_reward({"name": "clip_score", "model": clip_dir, "weight": 100, "device": "cpu"})
    np.testing.assert_allclose(hundred(IMAGES, PROMPTS).scores, 40 * out.scores, rtol=1e-5)


def test_aesthetic_is_the_affine_map_of_the_unit_image_embedding(clip_dir, head_file):
    path, state = head_file
    reward = build_reward({"name": "aesthetic", "model": clip_dir, "head": path, "device": "cpu"})
    out = reward(IMAGES, PROMPTS)
    model: Any = random_clip("tiny", "cpu", logit_scale=LOGIT_SCALE)[0]
    with torch.no_grad():
        e = model.get_image_features(pixel_values=by_hand_pixels(IMAGES)).pooler_output.double()
    e = (e / e.norm(dim=-1, keepdim=True)).numpy()
    # no activation between the layers: score = e . a + c with a = W0^T W2^T ... W7^T, c the biases carried through
    a, c = np.eye(16), np.zeros(16)
    for index in (0, 2, 4, 6, 7):
        w, b = (
            state[f"layers.{index}.weight"].double().numpy(),
            state[f"layers.{index}.bias"].double().numpy(),
        )
        a, c = a @ w.T, c @ w.T + b
    np.testing.assert_allclose(out.scores, (e @ a + c)[:, 0], rtol=1e-5, atol=1e-5)
    assert np.all(np.abs(out.scores - c[0]) <= np.linalg.norm(a) + 1e-5)  # the documented range
    other = reward(IMAGES, ["something else entirely"] * len(IMAGES))
    np.testing.assert_array_equal(other.scores, out.scores)  # the prompt is not used


@pytest.fixture(scope="module")
def hps_file(tmp_path_factory):
    model = random_open_clip("tiny")
    path = tmp_path_factory.mktemp("hps") / "HPS_tiny.pt"
    torch.save({"state_dict": model.state_dict()}, path)
    return str(path), model


def test_hps_is_the_cosine_of_open_clips_own_features(hps_file):
    import open_clip
    from PIL import Image

    path, model = hps_file
    out = build_reward({"name": "hps", "checkpoint": path, "architecture": TINY_OPEN_CLIP, "device": "cpu"})(
        IMAGES, PROMPTS
    )
    # open_clip's own evaluation preprocessing (on PIL images) and tokenizer, then its forward
    preprocess: Any = open_clip.image_transform(32, is_train=False)
    pixels = torch.stack([preprocess(Image.fromarray(im)) for im in IMAGES])
    with torch.no_grad():
        image, text, _ = model(pixels, open_clip.get_tokenizer("ViT-H-14")(PROMPTS))
    np.testing.assert_allclose(out.scores, (image * text).sum(-1).numpy(), atol=1e-5)
    assert np.all(np.abs(out.scores) <= 1.0)


@pytest.mark.parametrize("name", ["pickscore", "clip_score", "aesthetic", "hps"])
def test_scores_do_not_depend_on_the_batch(name, clip_dir, head_file, hps_file):
    options = {
        "pickscore": {"model": clip_dir, "processor": None},
        "clip_score": {"model": clip_dir},
        "aesthetic": {"model": clip_dir, "head": head_file[0]},
        "hps": {"checkpoint": hps_file[0], "architecture": TINY_OPEN_CLIP},
    }[name]
    images = np.concatenate([IMAGES, rng.integers(0, 256, (2, 48, 40, 3), dtype=np.uint8)[:, :32, :32]])
    prompts = [*PROMPTS, "a cat", "a cat"]
    # 3 images a forward: the batch is cut into chunks, and repeated prompts are encoded once
    reward = build_reward({"name": name, **options, "device": "cpu", "batch_size": 3})
    batch = reward(images, prompts).scores
    alone = np.concatenate([reward(images[i : i + 1], prompts[i : i + 1]).scores for i in range(len(images))])
    np.testing.assert_allclose(batch, alone, rtol=1e-5, atol=1e-5)
    assert len(reward(images[:0], []).scores) == 0


@pytest.mark.parametrize("name", ["pickscore", "clip_score", "aesthetic", "hps"])
def test_bfloat16_towers_score_near_float32(name, clip_dir, head_file, hps_file):
    options = {
        "pickscore": {"model": clip_dir, "processor": None},
        "clip_score": {"model": clip_dir, "weight": 100},
        "aesthetic": {"model": clip_dir, "head": head_file[0]},
        "hps": {"checkpoint": hps_file[0], "architecture": TINY_OPEN_CLIP},
    }[name]
    fp32 = build_reward({"name": name, **options, "device": "cpu"})(IMAGES, PROMPTS).scores
    bf16 = build_reward({"name": name, **options, "device": "cpu", "dtype": "bfloat16"})(
        IMAGES, PROMPTS
    ).scores
    assert bf16.dtype == np.float32
    np.testing.assert_allclose(bf16, fp32, atol=0.05 * np.abs(fp32).max())


def test_non_square_images_are_resized_and_centre_cropped(clip_dir):
    """A 32x64 image scores as its centre 32x32 (shortest side already at the model's size: no resize)."""
    wide = rng.integers(0, 256, (2, 32, 64, 3), dtype=np.uint8)
    reward = build_reward({"name": "clip_score", "model": clip_dir, "weight": 100, "device": "cpu"})
    np.testing.assert_allclose(
        reward(wide, PROMPTS[:2]).scores, reward(wide[:, :, 16:48], PROMPTS[:2]).scores, atol=1e-4
    )


def test_multi_reward_and_http_service_of_model_rewards(clip_dir, head_file):
    spec = [
        {"name": "pickscore", "model": clip_dir, "processor": None, "device": "cpu", "weight": 1 / 26},
        {"name": "aesthetic", "model": clip_dir, "head": head_file[0], "device": "cpu", "required": False},
    ]
    reward = build_reward(spec)
    local = reward(IMAGES, PROMPTS)
    np.testing.assert_allclose(
        local.scores, local.components["pickscore"] / 26 + local.components["aesthetic"], rtol=1e-5
    )
    with serve_in_thread(make_app(reward, "clip-models")) as url:
        remote = HttpReward(url, batch_size=4)(IMAGES, PROMPTS)
    np.testing.assert_allclose(remote.scores, local.scores, rtol=1e-5, atol=1e-6)  # batches of 4 + 2


def test_videos_are_refused(clip_dir):
    reward = build_reward({"name": "clip_score", "model": clip_dir, "device": "cpu"})
    with pytest.raises(ValueError, match="videos"):
        reward(np.zeros((1, 2, 32, 32, 3), np.uint8), ["a"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"name": "pickscore", "model": "/no/such/PickScore_v1"},
            "model='/no/such/PickScore_v1' is not a directory",
        ),
        ({"name": "clip_score", "model": "./missing"}, "model='./missing' is not a directory"),
        ({"name": "clip_score", "weight": 0}, "weight must be a positive number"),
        ({"name": "clip_score", "dtype": "fp8"}, "dtype must be"),
        ({"name": "aesthetic", "head": "/no/such/head.pth"}, "head='/no/such/head.pth' is not a file"),
        ({"name": "hps", "checkpoint": "/no/such/HPS.pt"}, "checkpoint='/no/such/HPS.pt' is not a file"),
        ({"name": "hps", "architecture": "ViT-Q-99"}, "not an open_clip model name"),
        ({"name": "pickscore", "modle": "x"}, "modle"),
    ],
)
def test_bad_specs_fail_in_one_line_before_loading(spec, message):
    with pytest.raises(ConfigError, match=message) as e:
        build_reward(spec)
    assert "\n" not in str(e.value)


def test_a_hub_id_not_in_the_cache_fails_in_one_line_when_offline():
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache") as e:
        build_reward({"name": "clip_score", "model": "nobody/no-such-clip", "device": "cpu"})
    assert "model='nobody/no-such-clip'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="hf download xswu/HPSv2 HPS_v2.1_compressed.pt"):
        build_reward({"name": "hps", "checkpoint": "v2.1", "device": "cpu"})


def test_a_checkpoint_of_another_network_fails_in_one_line(hps_file, tmp_path, clip_dir):
    path, model = hps_file
    state = model.state_dict()
    del state["ln_final.weight"]
    torch.save({"state_dict": state}, tmp_path / "broken.pt")
    with pytest.raises(ConfigError, match="does not fit open_clip"):
        build_reward(
            {"name": "hps", "checkpoint": str(tmp_path / "broken.pt"), "architecture": TINY_OPEN_CLIP}
        )
    torch.save(AestheticHead(32).state_dict(), tmp_path / "head32.pth")  # a head for 32-wide embeddings
    with pytest.raises(ConfigError, match="does not fit a predictor on 16-wide"):
        build_reward(
            {"name": "aesthetic", "model": clip_dir, "head": str(tmp_path / "head32.pth"), "device": "cpu"}
        )


def test_random_h14_has_open_clip_vit_h_14s_size():
    """The transformers CLIP-H/14 widths the benchmark times (PickScore's architecture) and open_clip's ViT-H-14
    (HPSv2's) are one network: the same number of parameters, built on the meta device."""
    model, _ = random_clip("h14", "meta")
    reference = random_open_clip("h14", "meta")
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in reference.parameters())
    assert 0.98e9 < count < 0.99e9  # CLIP ViT-H/14: 986 M


@pytest.fixture(scope="module")
def bench_rewards():
    """benchmarks/rewards.py, imported: its random model rewards are what the GPU rows time."""
    from fgrpo.scripts import load_script

    return load_script("benchmarks/rewards.py")


def _batch_equals_one_by_one(reward, images: np.ndarray, atol: float) -> np.ndarray:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(images))]
    batch = reward(images, prompts).scores
    alone = np.concatenate([reward(images[i : i + 1], prompts[i : i + 1]).scores for i in range(len(images))])
    assert batch.shape == (len(images),) and np.isfinite(batch).all()
    np.testing.assert_allclose(batch, alone, rtol=1e-4, atol=atol)
    return batch


@pytest.mark.parametrize("name", ["clip_score", "pickscore", "hps", "aesthetic", "imagereward"])
def test_the_benchmarks_tiny_model_rewards_score_a_batch(bench_rewards, name):
    reward = bench_rewards.random_model_reward(name, tiny=True, device="cpu", dtype="float32", batch=3)
    _batch_equals_one_by_one(reward, rng.integers(0, 256, (4, 48, 48, 3), dtype=np.uint8), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: real-size towers on the GPU")
@pytest.mark.parametrize("name", ["clip_score", "pickscore", "hps", "aesthetic", "imagereward"])
def test_real_size_model_rewards_batch_on_the_gpu(bench_rewards, name):
    """The real architectures (random weights) score 8 images of 512² on the GPU in batches of 4, as they
    score them one by one (up to cuDNN's TF32 convolutions, which may pick other kernels per batch size)."""
    reward = bench_rewards.random_model_reward(name, tiny=False, device="cuda", dtype="float32", batch=4)
    _batch_equals_one_by_one(reward, rng.integers(0, 256, (8, 512, 512, 3), dtype=np.uint8), atol=1e-2)
