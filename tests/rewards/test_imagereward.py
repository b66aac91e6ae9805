"""ImageReward on a tiny random BLIP (transformers' BlipVisionModel + BlipTextModel) with its head, loaded from a
checkpoint written under ImageReward's own key names (spelled out below, not by the module's converter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fgrpo.errors import ConfigError
from fgrpo.rewards import build_reward
from fgrpo.rewards.imagereward import TINY_TEXT, TINY_VISION
from fgrpo.rewards.random_clip import random_imagereward

rng = np.random.default_rng(0)
IMAGES = rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
PROMPTS = ["a red square", "a photo of a cat", "a red square", "hello world sign", "a dog"]
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073])
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711])


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def imagereward_names(model) -> dict[str, torch.Tensor]:
    """The model's weights under the names of ImageReward's checkpoint (BLIP's vit.py and med.py, `mlp.`)."""
    out = {}
    for key, value in model.state_dict().items():
        name = (
            key.replace("vision_model.embeddings.class_embedding", "blip.visual_encoder.cls_token")
            .replace("vision_model.embeddings.position_embedding", "blip.visual_encoder.pos_embed")
            .replace("vision_model.embeddings.patch_embedding", "blip.visual_encoder.patch_embed.proj")
            .replace("vision_model.encoder.layers.", "blip.visual_encoder.blocks.")
            .replace(".layer_norm1.", ".norm1.")
            .replace(".layer_norm2.", ".norm2.")
            .replace(".self_attn.qkv.", ".attn.qkv.")
            .replace(".self_attn.projection.", ".attn.proj.")
            .replace("vision_model.post_layernorm.", "blip.visual_encoder.norm.")
            .replace("text_encoder.", "blip.text_encoder.")
            .replace("head.layers.", "mlp.layers.")
        )
        out[name] = value.clone()
    # what the real checkpoint also holds and the score does not use
    out["blip.vision_proj.weight"], out["blip.text_proj.weight"] = torch.zeros(256, 32), torch.zeros(256, 32)
    out["blip.text_encoder.embeddings.position_ids"] = torch.arange(512)[None]
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, tokenizer = random_imagereward("tiny")
    path = tmp_path_factory.mktemp("imagereward")
    torch.save(imagereward_names(model), path / "ImageReward.pt")
    tokenizer.save_pretrained(path / "tokenizer")
    spec = {
        "name": "imagereward",
        "checkpoint": str(path / "ImageReward.pt"),
        "tokenizer": str(path / "tokenizer"),
        "device": "cpu",
        "vision": TINY_VISION,
        "text": TINY_TEXT,
    }
    return model, tokenizer, spec


def test_score_is_the_standardised_head_of_the_image_grounded_cls_feature(tiny):
    model, tokenizer, spec = tiny
    out = build_reward(spec)(IMAGES, PROMPTS)
    pixels = torch.from_numpy((IMAGES / 255.0 - CLIP_MEAN) / CLIP_STD).permute(0, 3, 1, 2).float()
    tokens = tokenizer(PROMPTS, padding="max_length", max_length=35, return_tensors="pt")
    with torch.no_grad():
        image = model.vision_model(pixel_values=pixels).last_hidden_state
        cls = model.text_encoder(
            input_ids=tokens["input_ids"],
            attention_mask=tokens["attention_mask"],
            encoder_hidden_states=image,
        ).last_hidden_state[:, 0]
        expected = (model.head(cls) - 0.16717362830052426) / 1.0333394966054072
    np.testing.assert_allclose(out.scores, expected.numpy(), rtol=1e-5, atol=1e-5)
    assert out.scores.dtype == np.float32


def test_the_image_and_the_prompt_both_move_the_score(tiny):
    reward = build_reward(tiny[2])
    same_prompt = reward(IMAGES[:2], ["a cat", "a cat"]).scores
    same_image = reward(IMAGES[[0, 0]], ["a cat", "a red square"]).scores
    assert abs(same_prompt[0] - same_prompt[1]) > 1e-4 and abs(same_image[0] - same_image[1]) > 1e-4


def test_prompts_are_cut_at_35_tokens(tiny):
    """[CLS] + 33 words + [SEP]: the words after the 33rd change nothing."""
    reward = build_reward(tiny[2])
    long = reward(IMAGES[:1], ["a " * 33 + "red cat on a blue square"]).scores
    cut = reward(IMAGES[:1], ["a " * 33]).scores
    np.testing.assert_allclose(long, cut, atol=1e-6)


def test_scores_do_not_depend_on_the_batch(tiny):
    reward = build_reward({**tiny[2], "batch_size": 2})
    batch = reward(IMAGES, PROMPTS).scores
    alone = np.concatenate([reward(IMAGES[i : i + 1], PROMPTS[i : i + 1]).scores for i in range(len(IMAGES))])
    np.testing.assert_allclose(batch, alone, rtol=1e-5, atol=1e-5)
    assert len(reward(IMAGES[:0], []).scores) == 0


def test_bfloat16_towers_score_near_float32(tiny):
    fp32 = build_reward(tiny[2])(IMAGES, PROMPTS).scores
    bf16 = build_reward({**tiny[2], "dtype": "bfloat16"})(IMAGES, PROMPTS).scores
    np.testing.assert_allclose(bf16, fp32, atol=0.05 * np.abs(fp32).max())


def test_a_checkpoint_with_an_unknown_key_fails_in_one_line(tiny, tmp_path):
    model, _, spec = tiny
    state = imagereward_names(model)
    state["blip.text_decoder.cls.predictions.bias"] = torch.zeros(3)
    torch.save(state, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="not an ImageReward checkpoint.*text_decoder") as e:
        build_reward({**spec, "checkpoint": str(tmp_path / "other.pt")})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"checkpoint": "/no/such/ImageReward.pt"}, "checkpoint='/no/such/ImageReward.pt' is not a file"),
        ({"checkpoint": "hub"}, "hf download THUDM/ImageReward ImageReward.pt"),
        ({"tokenizer": "/no/such/bert"}, "tokenizer='/no/such/bert' is not a directory"),
        ({"tokenizer": "nobody/no-such-bert"}, "not in the local Hugging Face cache"),
    ],
)
def test_missing_weights_fail_in_one_line(tiny, options, message):
    with pytest.raises(ConfigError, match=message) as e:
        build_reward({**tiny[2], **options})
    assert "\n" not in str(e.value)
