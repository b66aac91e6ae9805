"""benchmarks/vllm_omni_check.py's CPU self-test (`--cpu-selftest`, what runs without vLLM-Omni): it passes on the
directories the script writes, and its Qwen-Image-Edit part fails on a directory or condition images that the GPU
parity section could not use."""

import json
import sys
import tempfile
from pathlib import Path

import pytest
from PIL import Image

from fgrpo.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_omni_check.py"


@pytest.fixture(scope="module")
def check():
    module = load_script(SCRIPT)
    try:
        yield module
    finally:
        sys.modules.pop(module.__name__, None)


def test_cpu_selftest_runs_every_family_directory_the_edit_one_included(check, monkeypatch, capsys, tmp_path):
    """...and leaves nothing in the temporary folder (the family directories took 17 MB a run there)."""
    monkeypatch.setattr(sys, "argv", ["vllm_omni_check.py", "--cpu-selftest"])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    check.main()
    out = capsys.readouterr().out
    assert "qwen_image_edit directory and condition images ok" in out
    assert out.rstrip().endswith("cpu selftest ok")
    assert [p.name for p in tmp_path.iterdir()] == []


def test_the_edit_directory_names_the_edit_pipeline_and_carries_the_processor(check, tmp_path):
    path = check.save_tiny_edit_dir(tmp_path / "edit")
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    names = {p.name for p in (path / "processor").iterdir()}
    assert {"preprocessor_config.json", "video_preprocessor_config.json", "tokenizer_config.json"} <= names
    assert not (tmp_path / "edit.tmp").exists()
    prompts = check.write_edit_prompts(tmp_path / "images")
    assert [str(p) for p in prompts] == check.PROMPTS
    assert len({Image.open(p.image).tobytes() for p in prompts}) == len(prompts)  # pyright: ignore[reportAttributeAccessIssue]


def _break_directory(check, monkeypatch, damage):
    """save_tiny_edit_dir as the script has it, then `damage(path)`."""
    save = check.save_tiny_edit_dir

    def broken(path: Path) -> Path:
        out = save(path)
        damage(out)
        return out

    monkeypatch.setattr(check, "save_tiny_edit_dir", broken)


def _rename_architecture(path: Path) -> None:
    index = json.loads((path / "model_index.json").read_text())
    (path / "model_index.json").write_text(json.dumps(index | {"_class_name": "QwenImagePipeline"}))


def _released_pixel_bounds(path: Path) -> None:
    """The processor at Qwen2-VL's own pixel bounds: the trainer's condition images would take other VL tokens."""
    config = path / "processor" / "preprocessor_config.json"
    settings = json.loads(config.read_text())
    settings["size"] = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
    config.write_text(json.dumps(settings))


def _no_processor_tokenizer(path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / "processor" / name).unlink()


@pytest.mark.parametrize(
    "damage, error, match",
    [
        pytest.param(_rename_architecture, AssertionError, "'_class_name': 'QwenImagePipeline'", id="arch"),
        pytest.param(_released_pixel_bounds, AssertionError, "'longest_edge': 1003520", id="pixel_bounds"),
        # vLLM-Omni's read, Qwen2VLProcessor.from_pretrained(subfolder="processor"), finds no tokenizer
        pytest.param(_no_processor_tokenizer, ValueError, "tokenizer", id="processor_tokenizer"),
    ],
)
def test_the_edit_selftest_fails_on_a_broken_directory(check, monkeypatch, tmp_path, damage, error, match):
    _break_directory(check, monkeypatch, damage)
    with pytest.raises(error, match=match):
        check.selftest_edit_dir(tmp_path)


def test_the_edit_selftest_fails_when_the_condition_images_change_between_writings(
    check, monkeypatch, tmp_path
):
    write = check.write_edit_prompts
    calls = []

    def drifting(root: Path, *args, **kwargs):
        calls.append(root)
        return write(root, *args, seed=len(calls), **kwargs)  # a new draw on every call

    monkeypatch.setattr(check, "write_edit_prompts", drifting)
    with pytest.raises(AssertionError, match="edit_images_again"):  # the pixel comparison's message
        check.selftest_edit_dir(tmp_path)
    assert len(calls) == 2  # it got as far as the second writing


def test_the_bagel_directory_admits_the_engines_warm_up_request(check, tmp_path):
    """vLLM-Omni's engine warms up with a 512 x 512 request when it starts, and its BAGEL pipeline refuses a side
    over max_latent_size x VAE downsample x latent patch: the tiny directory's grid covers 512 px."""
    path = check.save_tiny_bagel_dir(tmp_path / "bagel", vllm_omni_parts=False)
    config = json.loads((path / "config.json").read_text())
    side = config["max_latent_size"] * config["vae_config"]["downsample"] * config["latent_patch_size"]
    assert side >= 512, config


def test_the_random_zimage_directory_loads_in_fgrpo_and_feeds_its_transformer(check, tmp_path):
    """The Z-Image parity's random directory (without --model-dir): the text encoder's width is the transformer's
    cap_feat_dim and fgrpo's ZImage loads it and samples a velocity. The transformer is shrunk here; on the GPU it
    has the released sizes, which vLLM-Omni builds whatever the config says."""
    import torch

    from fgrpo.models.zimage import ZImage

    small = dict(dim=64, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=256,
                 axes_dims=[16, 8, 8], axes_lens=[256, 64, 64])  # fmt: skip
    path = check.save_real_size_zimage_dir(tmp_path / "zimage", torch.device("cpu"), small)
    assert not (tmp_path / "zimage.tmp").exists()
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "ZImagePipeline" and index["text_encoder"] == [
        "transformers",
        "Qwen3ForCausalLM",
    ]
    text = json.loads((path / "text_encoder" / "config.json").read_text())
    assert text["hidden_size"] == 256
    model = ZImage.from_pretrained(path, dtype=torch.bfloat16, device="cpu")
    x = torch.randn(1, *model.latent_shape(64, 64), generator=torch.Generator().manual_seed(0))
    v = model.velocity(x, torch.tensor(0.5), model.encode(["a storefront sign"]), guidance_scale=1.0)
    assert v.shape == x.shape and torch.isfinite(v).all()
    assert check.save_real_size_zimage_dir(path, torch.device("cpu")) == path  # written once
