"""The real-size random models of benchmarks/rollout.py have the real widths (built on the meta device: shapes, no
memory), their stub encoders give the real conditioning shapes, and train_step.py / rollout.py run a tiny model of
each new family end to end on the CPU."""

import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fgrpo.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def bench():
    """`bench(name)` imports benchmarks/<name>.py, once per module: the scripts run in this process, where a
    subprocess of each would spend most of its time importing torch and diffusers again. benchmarks/ stays
    on the path for the scripts' own imports (rollout, vlm_model)."""
    sys.path.insert(0, str(BENCH))
    loaded = {}

    def load(name: str):
        if name not in sys.modules:
            loaded[name] = load_script(BENCH / f"{name}.py")
        return sys.modules[name]

    try:
        yield load
    finally:
        sys.path.remove(str(BENCH))
        for name in loaded:
            del sys.modules[name]


@pytest.fixture(scope="module")
def rollout(bench):
    return bench("rollout")


@pytest.fixture(scope="module")
def train_step(bench):
    return bench("train_step")


def run_main(script, monkeypatch, capsys, *args: str) -> str:
    """`script.main()` on the command line `args` (the tiny model): what it printed."""
    monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", "--tiny", *args])
    script.main()
    return capsys.readouterr().out


def refusal(script, monkeypatch, capsys, *args: str) -> str:
    """The one-line error `script.main()` stops with (argparse's exit 2, before any work): its stderr."""
    with pytest.raises(SystemExit) as e:
        run_main(script, monkeypatch, capsys, *args)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_real_qwen_image_edit_widths(rollout, tmp_path):
    model = rollout.build_real_qwen_image_edit("meta", layers=1)
    t = model.transformer
    p = next(t.parameters())
    assert (p.device.type, p.dtype) == ("meta", torch.bfloat16)
    # Qwen-Image's transformer config (diffusers' QwenImageTransformer2DModel defaults = Qwen/Qwen-Image
    # transformer/config.json): 24 heads x 128 = hidden 3072, text width 3584 (Qwen2.5-VL-7B's hidden size),
    # 64 input channels (16 latent channels x 2x2 patch).
    assert (t.config.num_attention_heads, t.config.attention_head_dim) == (24, 128)
    assert t.img_in.out_features == 3072 and t.txt_in.in_features == 3584 and t.img_in.in_features == 64
    assert len(t.transformer_blocks) == 1
    # AutoencoderKLQwenImage: z_dim 16, 8x spatial compression (3 downsamples).
    assert model.latent_channels == 16 and model.vae_scale == 8
    # QwenImageEditPipeline's condition area: 1024².
    assert model.condition_area == 1024 * 1024
    # A 512² condition image is resized to 1024² (its aspect ratio at the condition area); Qwen2-VL reads it as
    # (1036 / 28)² = 37² = 1369 tokens (sides rounded to 28 px), + 2 delimiters + ceil(35 / 4) = 9 instruction
    # tokens + the template's 5 suffix tokens = 1385.
    prompt = rollout.edit_prompts(['A storefront sign that says "WORD0"'], tmp_path, 512)[0]
    (embeds,) = model._encode_instruction((str(prompt), prompt.image))
    assert tuple(embeds.shape) == (1 + 1369 + 1 + 9 + 5, 3584)
    assert math.ceil(len(str(prompt)) / 4) == 9


def test_real_ltx2_widths(rollout):
    model = rollout.build_real_ltx2("meta", layers=1)
    t = model.transformer
    p = next(t.parameters())
    assert (p.device.type, p.dtype) == ("meta", torch.bfloat16)
    # diffusers' scripts/convert_ltx2_to_diffusers.py, version "2.3": video 32 heads x 128 = 4096, audio 32 x 64 =
    # 2048, cross-attention (text) widths 4096 / 2048, 128 video and 128 audio input channels.
    assert t.proj_in.in_features == 128 and t.proj_in.out_features == 32 * 128
    assert t.audio_proj_in.in_features == 128 and t.audio_proj_in.out_features == 32 * 64
    block = t.transformer_blocks[0]
    assert block.attn2.to_k.in_features == 4096 and block.audio_attn2.to_k.in_features == 2048
    assert len(t.transformer_blocks) == 1
    # Same file, connectors: Gemma 3 12B's 49 hidden states of width 3840 projected per modality to 4096 / 2048.
    c = model.connectors
    assert c.video_text_proj_in.in_features == 3840 * 49 == c.audio_text_proj_in.in_features
    assert (c.video_text_proj_in.out_features, c.audio_text_proj_in.out_features) == (4096, 2048)
    # Same file, VAEs: 128 video latent channels at 32x spatial / 8x temporal compression; audio latents of 8
    # channels x 64 / 4 = 16 mel bins (= the transformer's 128 audio channels); vocoder output at 48 kHz.
    assert (model.video_channels, model.spatial, model.temporal) == (128, 32, 8)
    assert (model.audio_channels, model.audio_mel_bins, model.audio_sample_rate) == (8, 16, 48000)
    # experiments/ltx2_ocr.py's clip: 81 frames of 256x384 at 24 fps -> (81 - 1) / 8 + 1 = 11 latent frames of
    # 8 x 12 tokens; audio: 81 / 24 s x 16000 / 160 / 4 = 84.375 -> 84 latent frames.
    assert (model.num_frames, model.height, model.width) == (81, 256, 384)
    assert model.grid == (11, 8, 12) and model.audio_frames == 84
    assert model.latent_shape(256, 384) == (11 * 8 * 12 * 128 + 84 * 8 * 16,)
    # The stub Gemma's states go through the connectors, which fill the 1024 tokens with registers.
    video, audio, mask = model._encode_one('A storefront sign that says "WORD0"')
    assert (
        tuple(video.shape) == (1024, 4096)
        and tuple(audio.shape) == (1024, 2048)
        and tuple(mask.shape) == (1024,)
    )


def test_real_flux_widths(rollout):
    model = rollout.build_real_flux("meta")
    t = model.transformer
    p = next(t.parameters())
    assert (p.device.type, p.dtype) == ("meta", torch.bfloat16)
    # black-forest-labs/FLUX.1-dev's transformer/config.json: 19 joint and 38 single-stream blocks of 24 heads x 128
    # = 3072, 64 input channels (16 latent channels x 2x2 packing), T5-XXL's 4096 and CLIP-L's pooled 768 as text
    # widths, the guidance embedding: 11.9 B parameters, FLUX.1-dev's published size.
    assert (len(t.transformer_blocks), len(t.single_transformer_blocks)) == (19, 38)
    assert t.x_embedder.in_features == 64 and t.x_embedder.out_features == 24 * 128
    assert t.context_embedder.in_features == 4096 and t.config.pooled_projection_dim == 768
    assert model.guidance_embeds and model.cfg_forwards == 1
    assert round(sum(q.numel() for q in t.parameters()) / 1e9, 1) == 11.9
    # vae/config.json: 16 latent channels, 8x spatial compression; a 512² image is 32 x 32 = 1024 tokens
    assert model.latent_shape(512, 512) == (16, 64, 64)
    embeds, pooled = model._encode_one('A storefront sign that says "WORD0"')
    assert tuple(embeds.shape) == (512, 4096) and tuple(pooled.shape) == (768,)


def test_real_flux2_widths(rollout):
    model = rollout.build_real_flux2("meta")
    t = model.transformer
    p = next(t.parameters())
    assert (p.device.type, p.dtype) == ("meta", torch.bfloat16)
    # FLUX.2 [klein] 4B's published transformer config: 5 joint and 20 single-stream blocks of 24 heads x 128 = 3072,
    # 128 input channels (32 latent channels x 2x2 patchify), text width 7680 (three stacked Qwen3-4B layers of
    # 2560), no guidance embedding (true CFG: two forwards a step): 3.9 B parameters, the "4B" of its name.
    assert (len(t.transformer_blocks), len(t.single_transformer_blocks)) == (5, 20)
    assert t.x_embedder.in_features == 128 and t.x_embedder.out_features == 24 * 128
    assert t.context_embedder.in_features == 7680
    assert model.cfg_forwards == 2
    assert round(sum(q.numel() for q in t.parameters()) / 1e9, 1) == 3.9
    # AutoencoderKLFlux2: 32 channels at 8x; packed 2x2, a 512² image is 32 x 32 = 1024 tokens of 128 channels
    assert model.latent_shape(512, 512) == (128, 32, 32)
    (embeds,) = model._encode_one('A storefront sign that says "WORD0"')
    assert tuple(embeds.shape) == (512, 7680)


def test_real_flux2_dev_widths(rollout):
    model = rollout.build_real_flux2_dev("meta")
    t = model.transformer
    p = next(t.parameters())
    assert (p.device.type, p.dtype) == ("meta", torch.bfloat16)
    # FLUX.2 [dev]'s published transformer config: 8 joint and 48 single-stream blocks of 48 heads x 128 = 6144, text
    # width 15360 (three stacked Mistral-Small-3.1 layers of 5120), the guidance embedding (one forward a step):
    # 32.2 B parameters, the "32B" of its model card
    assert (len(t.transformer_blocks), len(t.single_transformer_blocks)) == (8, 48)
    assert t.x_embedder.in_features == 128 and t.x_embedder.out_features == 48 * 128
    assert t.context_embedder.in_features == 15360 and t.time_guidance_embed.guidance_embedder is not None
    assert model.guidance_embeds and model.cfg_forwards == 1
    assert round(sum(q.numel() for q in t.parameters()) / 1e9, 1) == 32.2
    assert model.latent_shape(512, 512) == (128, 32, 32)
    (embeds,) = model._encode_one('A storefront sign that says "WORD0"')
    assert tuple(embeds.shape) == (512, 15360)
    # the benchmarks sample by experiments/flux2_ocr.py's `dev` preset
    assert (rollout.recipe("flux2_dev").sampling.height, rollout.recipe("flux2_dev").model.kind) == (
        512,
        "flux2_dev",
    )


def test_real_wan_a14b_widths(rollout):
    """Wan 2.2 T2V-A14B's published transformer config for each of its two experts: 40 blocks of 40 heads x 128 =
    5120, FFN 13824, text width 4096, 16 latent channels (the Wan 2.1 VAE, 8x): 14.3 B parameters each, 28.6 GB in
    bf16; the high-noise expert at t >= 875."""
    model = rollout.build_real_wan_a14b("meta")
    assert len(model.experts) == 2 and model.boundary_timestep == 875.0
    for t in model.experts:
        p = next(t.parameters())
        assert (p.device.type, p.dtype) == ("meta", torch.bfloat16)
        assert len(t.blocks) == 40 and t.config.num_attention_heads * t.config.attention_head_dim == 5120
        assert (t.config.ffn_dim, t.config.text_dim, t.config.in_channels) == (13824, 4096, 16)
        assert round(sum(q.numel() for q in t.parameters()) / 1e9, 1) == 14.3
    assert model.latent_shape(480, 480) == (16, 2, 60, 60)  # the a14b preset's 5 frames of 480x480


TRAIN_ARGS = ("--iters", "0", "--prompts", "1", "--group", "2", "--opt-steps", "1")


def test_train_step_tiny_qwen_image_edit(train_step, monkeypatch, capsys):
    out = run_main(train_step, monkeypatch, capsys, "--model", "qwen_image_edit", *TRAIN_ARGS)
    # the recipe: true-CFG 4, LoRA r64, micro-batch 4; the tiny model at 64²
    assert "qwen_image_edit, LoRA r64" in out and "TFLOP per 64² forward" in out and "## grpo: CFG 4.0" in out
    assert "| phase | s | images/GPU/s |" in out and "micro-batch 4, peak" in out
    assert "| total (rollout + train) |" in out
    assert "reward" not in out  # the default stub has no phase of its own


@pytest.mark.parametrize("stream", [False, True], ids=["after-rollout", "streamed-static-cache"])
def test_train_step_tiny_vlm_reward_scores_the_rollout(train_step, monkeypatch, capsys, stream):
    """--reward vlm: the tiny random Qwen2.5-VL reads the 4 rollout images (2 prompts x 2), and its text's OCR scores
    are what the advantages are computed from. The engine's answers are replaced after it has run, so the scores are
    known: the images of prompts "WORD0" x2, "WORD1" x2 (rows 0-3, in whatever micro-batches the rollout groups
    them) read as "WORD0", "", "WORD", "WORX1" score 1 - min(d, 5) / 5 = 1, 0,
    0.8, 0.8. Group means 0.5, 0.8; the batch's population std is sqrt(((0.35)² + (0.65)² + 2 (0.15)²) / 4)
    = sqrt(0.1475); advantages (r - group mean) / (std + 1e-4) = [0.5, -0.5, 0, 0] / (sqrt(0.1475) + 1e-4)."""
    from threading import current_thread

    from fgrpo.core import grpo
    from fgrpo.rewards.runner import RewardStream
    from fgrpo.rewards.vlm import TransformersOcrEngine

    read, texts = [], ["WORD0", "", "WORD", "WORX1"]
    real_recognize = TransformersOcrEngine.recognize

    def recognize(self, images):
        assert len(real_recognize(self, images)) == len(images)  # the tiny VLM itself reads them
        done = sum(r[0][0] for r in read if r[4] != "MainThread" or not stream)  # not the warm-up call
        read.append(
            (
                images.shape,
                images.dtype,
                self.batch_size,
                str(self.model.device),
                current_thread().name,
                self.cache,
                self.on_device,
                self.model.config.vision_config._attn_implementation,
            )
        )
        # the rows of these images: a streamed micro-batch's rows are those RewardStream.add was given
        rows = np.concatenate(added) if added else np.arange(4)
        return [texts[r] for r in rows[done : done + len(images)]]

    added = []
    real_add = RewardStream.add

    def add(self, rows, images, metadata=None):
        added.append(np.arange(len(self.prompts))[rows] if isinstance(rows, slice) else np.asarray(rows))
        return real_add(self, rows, images, metadata)

    fed = []
    real_advantages = grpo.group_advantages

    def group_advantages(rewards, group_size, **kw):
        fed.append(rewards.clone())
        return real_advantages(rewards, group_size, **kw)

    monkeypatch.setattr(TransformersOcrEngine, "recognize", recognize)
    monkeypatch.setattr(RewardStream, "add", add)
    monkeypatch.setattr(grpo, "group_advantages", group_advantages)
    args = ["--reward", "vlm", "--iters", "0", "--prompts", "2", "--group", "2", "--opt-steps", "1"]
    # streamed: the rollout's two micro-batches of 2 are read one by one, on the runner's thread (and the VLM
    # decodes with a static KV cache, its images processed on its device, its vision windows in one call a layer)
    streamed = ["--reward-stream", "--micro-batch", "2", "--reward-static-cache"]
    args += [*streamed, "--reward-image-backend", "torchvision", "--reward-varlen-vision"] if stream else []
    out = run_main(train_step, monkeypatch, capsys, *args)

    if stream:
        static = {"cache_implementation": "static"}
        # first one call on the training thread at the stream's block size, so that the static cache's compile
        # (torch.fx patches nn.Module.__call__ process-wide) never runs beside the rollout; then the two blocks
        v = "flash_varlen_torch"
        warm = ((2, 64, 64, 3), np.dtype(np.uint8), 4, "cpu", "MainThread", static, True, v)
        assert (
            read == [warm] + [((2, 64, 64, 3), np.dtype(np.uint8), 4, "cpu", "reward_0", static, True, v)] * 2
        )
    else:  # one generate batch of the rank's images, in the training thread
        assert read == [((4, 64, 64, 3), np.dtype(np.uint8), 4, "cpu", "MainThread", {}, False, "sdpa")]
    (rewards,) = fed
    torch.testing.assert_close(rewards, torch.tensor([1.0, 0.0, 0.8, 0.8]))
    adv = real_advantages(rewards, 2, std="global")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]) / (math.sqrt(0.1475) + 1e-4))
    step = next(line for line in out.splitlines() if line.startswith("step 0:"))
    assert re.search(r"rollout [0-9.]+s reward [0-9.]+s old-logprob", step)
    label = (
        r"reward \(random Qwen2.5-VL OCR, static cache, torchvision images, varlen vision, streamed: the wait\)"
        if stream
        else r"reward \(random Qwen2.5-VL OCR\)"
    )
    assert re.search(rf"^\| {label} \| [0-9.]+ \| [0-9.]+ \| - \|$", out, re.M)
    assert "| total (rollout + reward + train) |" in out


@pytest.mark.slow
def test_train_step_tiny_wan_a14b(train_step, monkeypatch, capsys):
    out = run_main(train_step, monkeypatch, capsys, "--model", "wan", "--wan-variant", "a14b", *TRAIN_ARGS)
    # the a14b preset: CFG 4, LoRA r64 on both experts of the tiny two-expert model
    assert "2 videos per step" in out and "wan, LoRA r64" in out
    assert "| phase | s | videos/GPU/s |" in out and "| total (rollout + train) |" in out


@pytest.mark.slow
def test_train_step_tiny_ltx2(train_step, monkeypatch, capsys):
    out = run_main(train_step, monkeypatch, capsys, "--model", "ltx2", *TRAIN_ARGS)
    # the recipe: CFG 4, LoRA r64, micro-batch 8; the tiny model's clip (9 frames of 32x32)
    assert "2 videos per step" in out and "ltx2, LoRA r64" in out and "TFLOP per 32x32 9-frame forward" in out
    assert "| phase | s | videos/GPU/s |" in out and "micro-batch 8, peak" in out
    assert "| total (rollout + train) |" in out


def test_real_bagel_widths(rollout):
    """BAGEL-7B-MoT's decoder: Qwen2.5-7B's widths (its released llm_config.json: 28 layers of 3584, MLP 18944,
    28 query heads of 128 over 4 key/value heads, vocabulary 152064) in each of the two experts, 14 B in all (7 B
    active a token); FLUX.1's VAE, 16 latent channels at an eighth of the side."""
    model = rollout.build_real_bagel("meta", layers=28)
    t = model.transformer
    widths = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    )
    assert [getattr(t, k) for k in widths] == [3584, 18944, 28, 28, 4] and t.vocab_size == 152064
    experts = {e: sum(p.numel() for n, p in t.named_parameters() if f".{e}." in n) for e in ("und", "gen")}
    assert experts["und"] == experts["gen"] and round(experts["gen"] / 1e9, 1) == 6.5
    assert round(sum(p.numel() for p in t.parameters()) / 1e9) == 14
    assert model.latent_shape(512, 512) == (16, 64, 64)


def test_train_step_tiny_bagel(train_step, monkeypatch, capsys):
    """#44's GPU row is this command at real size: the tiny BAGEL through the trainer (its recipe's CFG 4)."""
    out = run_main(train_step, monkeypatch, capsys, "--model", "bagel", *TRAIN_ARGS)
    assert "bagel, LoRA r64" in out and "TFLOP per 64² forward" in out and "## grpo: CFG 4.0" in out
    assert "| total (rollout + train) |" in out and "gap 0.00e+00" in out


def test_train_step_tiny_flux2_dev(train_step, monkeypatch, capsys):
    out = run_main(train_step, monkeypatch, capsys, "--model", "flux2_dev", *TRAIN_ARGS)
    # the `dev` preset: embedded guidance 4, LoRA r64, micro-batch 4; the tiny model at 64²
    assert "flux2_dev, LoRA r64" in out and "TFLOP per 64² forward" in out and "## grpo: CFG 4.0" in out
    assert "micro-batch 4, peak" in out and "| total (rollout + train) |" in out


@pytest.mark.slow
@pytest.mark.parametrize("model,per_s", [("qwen_image_edit", "img/s"), ("ltx2", "vid/s"), ("flux", "img/s")])
def test_rollout_tiny(rollout, monkeypatch, capsys, model, per_s):
    out = run_main(
        rollout, monkeypatch, capsys, "--model", model, "--batch-sizes", "2", "--group", "2", "--steps", "4"
    )
    header = next(line for line in out.splitlines() if line.startswith("mode"))
    assert per_s in header
    assert [line.split()[:2] for line in out.splitlines() if line.startswith("eager")][-1] == ["eager", "2"]
    assert "failed" not in out


def test_attention_tiny_switches_the_backend_of_every_processor():
    """benchmarks/attention.py on the tiny Qwen-Image: the reference row diffs 0 against itself, the math kernel
    gives other bits (so the switch reached the processors), the flash kernel refuses the joint CFG forward's mask
    and takes the split CFG forwards (they carry none), and FlexAttention reads that mask as SDPA does."""
    # in a process of its own: run in the test's process it left a FlexAttention torch-function mode active,
    # which broke the next test's forward
    res = subprocess.run(
        [sys.executable, str(BENCH / "attention.py"), "--tiny", "--backends", "native,_native_math,_native_flash,flex"]
        + ["--modes", "eager", "--iters", "1", "--size", "64"],
        env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    cells = {
        tuple(c.strip() for c in line.split("|")[2:5]): line.split("|")[5:]
        for line in out.splitlines()
        if line.startswith("| eager")
    }
    assert float(cells[("joint", "16", "native")][3]) == 0.0
    assert 0 < float(cells[("joint", "16", "_native_math")][3]) < 1e-4
    assert "attn_mask` is not supported" in cells[("joint", "16", "_native_flash")][0]
    assert 0 <= float(cells[("none", "16", "_native_flash")][3]) < 1e-4
    assert 0 < float(cells[("joint", "16", "flex")][3]) < 1e-4
    assert 0 <= float(cells[("split", "16", "_native_flash")][3]) < 1e-4


def test_train_step_reads_prompts_of_different_lengths_and_compares_the_cfg_forwards(
    train_step, tmp_path, monkeypatch, capsys
):
    """--prompt-file gives the steps prompts of different lengths (the default ones share one), each step the file's
    next lines (3 prompts over the 3 steps of 2); --warmup 2 leaves the third step alone in the table; --split-cfg off,on runs the one masked CFG forward and the two
    unpadded ones in turn; a file too short stops before any work."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        'A sign that says "HI"\n\nA poster of a quiet lake at dawn with the words "Good Morning"\nA red "STOP" sign\n'
    )
    out = run_main(
        train_step, monkeypatch, capsys, "--warmup", "2", "--iters", "1", "--prompts", "2", "--group", "2", "--opt-steps", "1",
        "--prompt-file", str(prompts), "--split-cfg", "off,on",
    )  # fmt: skip
    header = r"# prompt tokens (\d+)-(\d+) over 3 prompts\n"
    short, long = map(int, re.search(header, out).groups())  # type: ignore[union-attr]
    assert short < long
    # two warm-up steps, then the one timed step is the table's (of each CFG setting: the last table is split's)
    assert out.count("step 2: rollout") == 2 and "step 3:" not in out
    last = re.findall(r"step 2: rollout ([\d.]+)s", out)[-1]
    assert re.findall(r"\| rollout \| ([\d.]+) \|", out)[-1] == last
    assert "## grpo: CFG 4.0\n" in out and "## grpo: CFG 4.0, CFG as two unpadded forwards\n" in out
    err = refusal(train_step, monkeypatch, capsys, "--prompts", "4", "--prompt-file", str(prompts))
    assert "--prompt-file" in err and "at least --prompts 4 lines" in err


def test_train_step_eager_vae_needs_compile(train_step, monkeypatch, capsys):
    """--eager-vae only changes what --compile compiles: alone it is refused before any work."""
    err = refusal(train_step, monkeypatch, capsys, "--eager-vae")
    assert "--eager-vae" in err and "add --compile" in err


def test_kernel_profile_counts_the_union_of_overlapping_kernels(train_step):
    """--profile's lines from hand-made profiler events: kernels on [0, 1), [0.5, 2) and [3, 4) s (two streams
    overlap on [0.5, 1)) keep the GPU busy 2 + 1 = 3 s of a 10-s step; kernel "a" ran 1 + 1 s, "b" 1.5 s; the
    host's ops count for neither, nor does a range's copy on the GPU's track; each phase range counts the kernels'
    time inside it. The one gap between kernels, [2, 3), is 0.5 s into the train range [2, 3.5): the host's
    thread 0 then ran "cpu op" [0, 9) and inside it cudaStreamSynchronize [2.2, 2.9) (the innermost), thread 7
    aten::copy_ [2.4, 2.6)."""
    from torch.autograd.profiler_util import FunctionEvent
    from torch.profiler import DeviceType

    def event(name, start_s, end_s, device_type=DeviceType.CUDA, thread=0, annotation=False):
        return FunctionEvent(
            0,
            name,
            thread,
            int(start_s * 1e6),
            int(end_s * 1e6),
            device_type=device_type,
            is_user_annotation=annotation,
        )

    events = [event("a", 0, 1), event("b", 0.5, 2), event("a", 3, 4), event("cpu op", 0, 9, DeviceType.CPU)]
    events += [
        event("cudaStreamSynchronize", 2.2, 2.9, DeviceType.CPU),
        event("aten::copy_", 2.4, 2.6, DeviceType.CPU, thread=7),
    ]
    # the PhaseTimer's ranges: rollout [0, 1.5) holds 1.5 s of kernels; train, entered twice, [2, 3.5) and
    # [3.5, 5) holds 0.5 + 0.5 s of the last kernel [3, 4) in 3 s; reward [1.5, 2) the last 0.5 s of "b"
    phases = [("rollout", 0, 1.5), ("train", 3.5, 5), ("reward", 1.5, 2), ("train", 2, 3.5)]
    events += [event(f"phase:{name}", a, b, DeviceType.CPU, annotation=True) for name, a, b in phases]
    events += [event("phase:train", 2, 3.5, annotation=True)]  # the range on the GPU's track: no kernel
    assert train_step.busy_seconds([(0, 10), (5, 20), (30, 40)]) == pytest.approx(30e-6)
    assert train_step.busy_seconds([(0, 10), (2, 4)]) == pytest.approx(10e-6)  # one inside another
    none = "#   idle: 0.00 s in 0 gaps < 20 us, 0.00 s in 0 gaps 20 us - 1 ms, 0.00 s in 0 gaps >= 1 ms"
    assert train_step.kernel_profile(events, 10.0) == [
        "# profiled step: 3 kernels, GPU busy 3.00 of 10.00 s (30.0%)",
        "# phase rollout: GPU busy 1.50 of 1.50 s (100.0%)",  # in the order the phases began
        none + "; the longest 0.0 ms",
        "# phase reward: GPU busy 0.50 of 0.50 s (100.0%)",
        none + "; the longest 0.0 ms",
        "# phase train: GPU busy 1.00 of 3.00 s (33.3%)",
        # [2, 3) before the last kernel, [4, 5) after it
        "#   idle: 0.00 s in 0 gaps < 20 us, 0.00 s in 0 gaps 20 us - 1 ms, 2.00 s in 2 gaps >= 1 ms; the longest "
        "1000.0 ms",
        "#   gap of 1000.0 ms (train +0.50 s): thread 0 in cudaStreamSynchronize; thread 7 in aten::copy_",
        "# other: 3.50s (116.7% of the busy time)",  # the two streams' overlap counts in each kernel's time
        "#   a: 2.00s x2",
        "#   b: 1.50s x1",
    ]


def test_kernel_profile_gives_each_cuda_streams_busy_time_by_phase(train_step):
    """Kernels on two CUDA streams (the streamed reward reads on its own): stream 7 runs [0, 1) and [3, 4) s,
    stream 20 [0.5, 2). Phases rollout [0, 1.5), reward [1.5, 2), train [2, 3.5) and [3.5, 5). Stream 7 is busy
    2 s: 1 in the rollout, 0.5 + 0.5 in train; stream 20 1.5 s: 1 in the rollout, 0.5 in the reward. They run at
    once on [0.5, 1): 2 + 1.5 - the union's 3 = 0.5 s. One stream gives no stream lines."""
    from torch.autograd.profiler_util import FunctionEvent
    from torch.profiler import DeviceType

    def kernel(start_s, end_s, stream):
        return FunctionEvent(
            0,
            "k",
            0,
            int(start_s * 1e6),
            int(end_s * 1e6),
            device_type=DeviceType.CUDA,
            device_resource_id=stream,
        )

    kernels = [kernel(0, 1, 7), kernel(3, 4, 7), kernel(0.5, 2, 20)]
    ranges = [("rollout", 0, 1.5e6), ("reward", 1.5e6, 2e6), ("train", 2e6, 3.5e6), ("train", 3.5e6, 5e6)]
    assert train_step.stream_lines(kernels, ranges) == [
        "# stream 7: busy 2.00 s in 2 kernels (rollout 1.00 s, reward 0.00 s, train 1.00 s)",
        "# stream 20: busy 1.50 s in 1 kernels (rollout 1.00 s, reward 0.50 s, train 0.00 s)",
        "#   streams at once: 0.50 s",
    ]
    assert train_step.stream_lines(kernels[:2], ranges) == []
    phases = [
        FunctionEvent(0, f"phase:{n}", 0, int(a), int(b), is_user_annotation=True) for n, a, b in ranges
    ]
    lines = train_step.kernel_profile(kernels + phases, 5.0)  # after the phases' lines
    streams = train_step.stream_lines(kernels, ranges)
    at = lines.index(streams[0])
    assert lines[at : at + 3] == streams and lines[at - 1].startswith("#   idle")


def test_idle_gaps_by_length(train_step):
    """Kernels (microseconds) [0, 10), [15, 30), [100, 200), [2000, 2100) in a window [-50, 2200): the gaps are 50
    (before the first), 5, 70, 1800 and 100 (after the last): 5 below 20 us; 50 + 70 + 100 between 20 us and 1 ms;
    1800 from 1 ms. Overlapping kernels leave no gap: [0, 10) and [5, 12) end at 12."""
    intervals = [(0, 10), (15, 30), (100, 200), (2000, 2100)]
    buckets, longest = train_step.idle_gaps(intervals, -50, 2200)
    assert buckets == [[1, pytest.approx(5e-6)], [3, pytest.approx(220e-6)], [1, pytest.approx(1800e-6)]]
    assert longest == pytest.approx(1.8e-3)
    assert train_step.idle_gaps([(0, 10), (5, 12), (12, 20)], 0, 20) == ([[0, 0], [0, 0], [0, 0]], 0.0)


def test_longest_gaps_between_kernels(train_step):
    """Gaps between merged kernels (microseconds) [0, 10), [5, 12), [1012, 1100), [1200, 1300), [4300, 4400): 1000,
    100 and 3000; of at least 1000, longest first: (1300, 4300), then (12, 1012). None before the first kernel."""
    intervals = [(1200, 1300), (0, 10), (5, 12), (1012, 1100), (4300, 4400)]
    assert train_step.longest_gaps(intervals, 5, 1000) == [(1300, 4300), (12, 1012)]
    assert train_step.longest_gaps(intervals, 1, 1000) == [(1300, 4300)]


def test_kernel_families_by_name(train_step):
    """--profile's families: the real-size step's own kernel names (RESULTS fp8-2: cuBLAS's float8 matmul, cuDNN's
    attention, inductor's float8 cast, which fuses _scaled_mm's input cast and so holds `_scaled_mm` in its name, an
    eager kernel) and names of the same form for the other families; each family's seconds and share of the busy
    time."""
    from torch.autograd.profiler_util import FunctionEvent
    from torch.profiler import DeviceType

    names = {
        "nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_TNT": "float8 matmul",
        "nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopB_TNN": "matmul or convolution (implicit GEMM)",
        "triton_tem_fused_mm_0": "matmul or convolution (implicit GEMM)",
        "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc": "matmul or convolution (implicit GEMM)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x": "attention",
        "triton_red_fused__scaled_mm__to_copy_abs_add_amax_clamp_exp2_floor_gelu_log2_mul": (
            "Triton: float8 casts (amax, scale) fused"
        ),
        "triton_per_fused_add_mul_native_layer_norm_0": "Triton: other fused ops",
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<a": "eager ATen ops",
        "ncclDevKernel_AllGather_RING_LL": "NCCL",
        "Memcpy HtoD (Pageable -> Device)": "copies and fills",
        "void some_library::kernel<float>": "other",
    }
    assert {n: train_step.kernel_kind(n) for n in names} == names
    events = [
        FunctionEvent(0, "nvjet_sm90_qqtst_x", 0, 0, 3_000_000, device_type=DeviceType.CUDA),
        FunctionEvent(0, "sdpa_flash_fprop", 0, 3_000_000, 4_000_000, device_type=DeviceType.CUDA),
    ]
    lines = train_step.kernel_profile(events, 8.0)
    assert lines[1:3] == [
        "# float8 matmul: 3.00s (75.0% of the busy time)",
        "# attention: 1.00s (25.0% of the busy time)",
    ]


def fake_kineto_event(name, device_type, start_ns, end_ns, thread=0, annotation=False):
    """One event of a profiler's Kineto results, as `train_step.trace_events` reads it: each field a method."""
    from types import SimpleNamespace

    fields = {
        "name": name,
        "device_type": device_type,
        "start_ns": start_ns,
        "end_ns": end_ns,
        "start_thread_id": thread,
        "device_resource_id": thread,
        "is_user_annotation": annotation,
        "is_hidden_event": False,
    }
    return SimpleNamespace(**{k: (lambda v=v: v) for k, v in fields.items()})


class FakeProfiler:
    """torch.profiler.profile's stand-in: one kernel of 1 ms in its Kineto results; its teardown takes
    `teardown_s`."""

    teardown_s = 0.0

    def __init__(self, activities, experimental_config):
        from types import SimpleNamespace

        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import DeviceType

        # the host ops of every thread: the streamed reward's too, not only the thread that started the profiler
        every_thread = _ExperimentalConfig(profile_all_threads=True)
        assert experimental_config.__getstate__() == every_thread.__getstate__()

        kernel = fake_kineto_event("gemm", DeviceType.CUDA, 5_000, 1_005_000)
        results = SimpleNamespace(trace_start_ns=lambda: 5_000, events=lambda: [kernel])
        self.profiler = SimpleNamespace(kineto_results=results)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        time.sleep(self.teardown_s)


def test_trace_events_are_the_profilers_own_events_without_its_event_tree(train_step):
    """`trace_events` reads the Kineto results directly: the same events as `prof.events()` (names, device, user
    annotations, threads, start and end to the bit), profiler-internal ones left out as torch leaves them out.
    A real CPU trace: ops in two threads, a record_function range in each, the side thread started before the
    profiler (as the reward's pool) and, as train_step's profile, every thread recorded."""
    import threading

    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile, record_function

    def work(tag: str, go: threading.Event | None = None):
        if go is not None:
            go.wait()
        with record_function(f"phase:{tag}"):
            x = torch.ones(16, 16)
            for _ in range(20):
                x = (x @ x).tanh()

    go = threading.Event()
    side = threading.Thread(target=work, args=("reward", go))
    side.start()
    every_thread = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        go.set()
        work("rollout")
        side.join()

    def key(e):
        return (
            e.name,
            e.device_type,
            e.is_user_annotation,
            e.thread,
            e.device_resource_id,
            e.time_range.start,
            e.time_range.end,
        )

    ours = sorted(map(key, train_step.trace_events(prof)), key=str)
    assert ours == sorted(map(key, prof.events() or []), key=str)
    assert {e[0] for e in ours} >= {"phase:rollout", "phase:reward", "aten::mm", "aten::tanh"}
    assert len({e[3] for e in ours if e[0] == "aten::mm"}) == 2  # both threads'
    assert not {e[0] for e in ours} & set(train_step.PROFILER_INTERNAL)


def fake_phases(monkeypatch, *, rollout_s=lambda step: 1.25, window=None, calls=None):
    """Trainer.experience and Trainer.update replaced by fakes that only fill the step's PhaseTimer: 'rollout'
    rollout_s(step) s, 'train' 2.5 s, two samples whose windows are window(step) (none by default); each call
    appended to `calls` as (phase, step)."""
    from fgrpo.async_mode import Batch
    from fgrpo.train import Trainer

    def experience(self, step, timer):
        if calls is not None:
            calls.append(("experience", step))
        timer.times.update(rollout=rollout_s(step), reward=0.0, sync=0.0)
        traj = SimpleNamespace(window=torch.zeros(2, 0, dtype=torch.long) if window is None else window(step))
        return Batch(step, traj, torch.zeros(2), torch.zeros(2), {})  # pyright: ignore[reportArgumentType]

    def update(self, step, batch, timer, off_policy=False):
        if calls is not None:
            calls.append(("update", step))
        timer.times["train"] = 2.5
        return {"skipped_steps": 0.0, "optimizer_steps": 1.0}

    monkeypatch.setattr(Trainer, "experience", experience)
    monkeypatch.setattr(Trainer, "update", update)


def test_train_step_times_the_trainers_own_phases(train_step, monkeypatch, capsys):
    """The table's seconds are those the Trainer's own phases record: with Trainer.experience taking 1.25 s of
    'rollout' and Trainer.update 2.5 s of 'train' (fakes that only fill the step's PhaseTimer), the row says
    rollout 1.25, train 2.50 and 2 images / 3.75 s = 0.533 images/GPU/s."""
    calls = []
    fake_phases(monkeypatch, calls=calls)
    out = run_main(train_step, monkeypatch, capsys, "--algo", "nft", "--iters", "1", *TRAIN_ARGS[2:])
    assert calls == [("experience", 0), ("update", 0), ("experience", 1), ("update", 1)]
    assert "| rollout | 1.25 | 1.600 |" in out and "| train | 2.50 | 0.800 |" in out
    assert "| total (rollout + train) | 3.75 | 0.533 |" in out


def test_the_profiled_steps_busy_share_is_of_the_step_not_of_the_profilers_teardown(
    train_step, monkeypatch, capsys
):
    """--profile's busy share divides by the profiled step's own wall time. Read after the profiler stopped, the wall
    took in its teardown and event tables (a real-size step: 140 s for a 31-s step, so 19 % busy instead of 87 %).
    Here the fake profiler's teardown takes 0.5 s and the fake step almost none: the share's wall stays below."""
    fake_phases(monkeypatch)
    monkeypatch.setattr(FakeProfiler, "teardown_s", 0.5)
    monkeypatch.setattr(torch.profiler, "profile", FakeProfiler)
    out = run_main(
        train_step, monkeypatch, capsys, "--algo", "nft", "--iters", "1", "--profile", *TRAIN_ARGS[2:]
    )
    line = next(x for x in out.splitlines() if x.startswith("# profiled step:"))
    wall = float(line.split(" of ")[1].split(" s ")[0])
    assert line.startswith("# profiled step: 1 kernels, GPU busy 0.00 of ") and wall < 0.5


def test_graph_steps_counts_the_steps_a_micro_batch_runs_with_a_row_in_its_window(train_step):
    """8 samples, windows of 2 starting at 3, 0, 3, 0, 1, 2, 1, 0, forwards of 4. Consecutive rows: rows 0-3 touch
    steps {0, 1, 3, 4}, rows 4-7 {0, 1, 2, 3}: 4 each. Sorted by start (rows 1, 3, 7, 4 | 6, 5, 0, 2): {0, 1, 2}
    and {1, 2, 3, 4}: 3.5 on average."""
    start = torch.tensor([3, 0, 3, 0, 1, 2, 1, 0])
    window = torch.stack([start, start + 1], dim=1)
    assert train_step.graph_steps(window, 4) == (3.5, 4.0)


def test_every_step_says_how_many_of_its_rollout_steps_ran_the_training_graph(
    train_step, monkeypatch, capsys
):
    """The step lines carry each step's own count (its windows are its own draws; the rollout of a step with more
    such steps is slower), not only the first step's. Fakes of the Trainer's phases give two rows, one forward
    (--compile only names the setting: the fakes run no model): windows at 0 and 1 in the warm-up step (steps
    {0, 1, 2}: 3), at 0 and 2 in the timed one ({0, 1, 2, 3}: 4)."""
    fake_phases(monkeypatch, window=lambda step: torch.tensor([[0, 1], [1 + step % 2, 2 + step % 2]]))
    out = run_main(
        train_step, monkeypatch, capsys, "--algo", "nft", "--compile", "--iters", "1", *TRAIN_ARGS[2:]
    )
    lines = [x for x in out.splitlines() if x.startswith("# step") and "through the training graph" in x]
    assert [x.split(" of ")[0] for x in lines] == ["# step 0: 3.00", "# step 1: 4.00"]


def test_the_profiled_step_comes_after_the_timed_ones_and_stays_out_of_the_table(
    train_step, monkeypatch, capsys
):
    """--profile runs one step more than --warmup + --iters in the last setting, under the profiler, and the tables'
    means are the timed steps' only: the profiler slows the step it watches (RESULTS fp8-2's profiled step was the
    slowest of its three), and its teardown takes minutes at real size, so the other settings run none. Here the
    fake rollout takes 1.25 s in the timed steps and 9 s in the profiled one: both tables say 1.25."""
    calls = []
    fake_phases(monkeypatch, rollout_s=lambda step: 9.0 if step == 2 else 1.25, calls=calls)
    monkeypatch.setattr(torch.profiler, "profile", FakeProfiler)
    out = run_main(
        train_step, monkeypatch, capsys, "--algo", "nft,awm", "--iters", "1", "--profile", *TRAIN_ARGS[2:]
    )
    # each setting a warm-up and a timed step; the last one the profiled step too
    assert [step for phase, step in calls if phase == "experience"] == [0, 1, 0, 1, 2]
    assert "step 2: rollout 9.00s" in out and out.count("# profiled step: 1 kernels") == 1
    assert (
        out.count("| rollout | 1.25 | 1.600 |") == 2
        and out.count("| total (rollout + train) | 3.75 | 0.533 |") == 2
    )


def test_counting_the_flops_of_compiled_blocks_leaves_them_compiled(rollout):
    """forward_tflop runs the model under torch's flop counter (a dispatch mode dynamo will not trace); counted on
    blocks already compiled, dynamo marked their code as skipped for the rest of the process, and every later
    no-grad forward of the headline step ran eager (its rollout 4 s slower). Counted eagerly, they stay compiled."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    backend = CompileCounter()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.proj(x)) + x

    block = Block()
    block.compile(backend=backend)
    model = SimpleNamespace(
        transformer=block,
        latent_shape=lambda h, w: (4,),
        encode=lambda prompts: {},
        velocity=lambda x, sigma, cond, guidance_scale: block(x),
    )
    assert rollout.forward_tflop(model, "a", 8, 8) == pytest.approx(
        2 * 4 * 4 / 1e12
    )  # one [1, 4] x [4, 4] matmul
    with torch.no_grad():
        block(torch.ones(2, 4))
    assert backend.frame_count == 1
    torch._dynamo.reset()


@pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="needs the fp8 extra (uv sync --extra fp8)"
)
def test_train_step_fp8_rollout(train_step, monkeypatch, capsys):
    """--fp8 rowwise,tensorwise runs the merged rollout on float8 copies of each scaling in turn through
    the trainer (the first update's gap stays 0); --fp8-deviation then prints the four rollouts' table, whose
    reference row is 0 and whose float8 rows move the final latents by a little; without --merged-rollout on, or
    with an unknown scaling, it stops before any work."""
    from fgrpo.models import lora

    made = []
    real = lora.float8_weight
    monkeypatch.setattr(lora, "float8_weight", lambda *a: made.append(a[1]) or real(*a))
    out = run_main(
        train_step,
        monkeypatch,
        capsys,
        *TRAIN_ARGS,
        "--group",
        "16",
        "--shard",
        "adapters",
        "--merged-rollout",
        "on",
        "--fp8",
        "rowwise,tensorwise",
        "--fp8-deviation",
    )
    assert "merged LoRA outside the window (rollout), float8 rowwise\n" in out
    assert "merged LoRA outside the window (rollout), float8 tensorwise\n" in out
    assert out.count("first-update log-prob gap 0.0e+00") == 2
    assert {"rowwise", "tensorwise"} <= set(made)  # the trainer's rollouts did quantize their merged copies
    rows = {
        line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in out.splitlines() if line.startswith("| ")
    }
    assert set(rows["merged bf16 (reference)"][:-1]) <= {"0.00e+00", "0.0e+00"} or all(
        float(x) == 0 for part in rows["merged bf16 (reference)"][:-1] for x in part.split(" / ")
    )
    for label in ("float8 rowwise", "float8 tensorwise"):
        x0 = float(rows[label][1])
        assert 0 < x0 < 0.1, (
            label,
            x0,
        )  # e4m3 outside the window: a small relative move of the final latents
        prefix, kl, log_prob = rows[label][0], float(rows[label][2]), float(rows[label][3])
        # the latest window starts after merged steps (an earlier one can share its micro-batch with a window at 0)
        assert float(prefix.split(" / ")[-1]) > 0 and kl > 0
        # the window's log-probs are those of each transition's own noise, up to the rounding of x - mean
        assert log_prob < 1e-5, (label, log_prob)
    for args in (("--fp8", "rowwise"), ("--merged-rollout", "on", "--fp8", "blockwise")):
        err = refusal(train_step, monkeypatch, capsys, "--shard", "adapters", *args)
        assert "--fp8" in err


@pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="needs the fp8 extra (uv sync --extra fp8)"
)
def test_train_step_fp8_train(train_step, monkeypatch, capsys):
    """--fp8 train converts the LoRA layers' frozen base to float8 through the trainer's model setup, and the first
    update's gap stays 0. In one process, `train+rowwise,off,train` runs off first (the conversion cannot be undone),
    then converts once, then runs both train settings: the merged rollout's copies in float8 and in bf16.
    train+tensorwise keeps the copies with one scale per tensor and trains rowwise, gap 0. With --full,
    --fp8-deviation or float8 copies without the merged rollout it stops before any work."""
    from fgrpo.models import lora

    made: list[list[str]] = []
    real = lora.float8_base_layers

    def spy(*a):
        made.append(real(*a))
        return made[-1]

    monkeypatch.setattr(lora, "float8_base_layers", spy)
    out = run_main(train_step, monkeypatch, capsys, *TRAIN_ARGS, "--fp8", "train")
    assert "the LoRA's base in float8 (rowwise) everywhere\n" in out
    assert "first-update log-prob gap 0.0e+00" in out
    assert len(made) == 1 and made[0]  # converted once, before the first rollout
    made.clear()
    merged = ("--merged-rollout", "on", "--shard", "adapters", "--fp8")
    out = run_main(train_step, monkeypatch, capsys, *TRAIN_ARGS, *merged, "train+rowwise,off,train")
    headers = [line for line in out.splitlines() if line.startswith("## grpo")]
    assert headers == [
        "## grpo: CFG 4.0, merged LoRA outside the window (rollout)",
        "## grpo: CFG 4.0, merged LoRA outside the window (rollout), float8 rowwise, the LoRA's base in float8 "
        "(rowwise) everywhere",
        "## grpo: CFG 4.0, merged LoRA outside the window (rollout), the LoRA's base in float8 (rowwise) everywhere",
    ]
    assert out.count("first-update log-prob gap 0.0e+00") == 3 and len(made) == 1 and made[0]
    made.clear()
    out = run_main(train_step, monkeypatch, capsys, *TRAIN_ARGS, *merged, "train+tensorwise")
    assert "float8 tensorwise, the LoRA's base in float8 (rowwise) everywhere\n" in out
    assert "first-update log-prob gap 0.0e+00" in out and len(made) == 1 and made[0]
    for args in (
        ("--fp8", "train", "--full"),
        ("--fp8", "tensorwise"),
        (*merged, "train", "--fp8-deviation"),
    ):
        assert "--fp8" in refusal(train_step, monkeypatch, capsys, *args)


def test_rollout_deviation_closed_form(train_step):
    """rollout_deviation on two hand-made rollouts: the window-start states differ by a known vector for the sample
    whose window starts after 2 steps, the final latents of one sample by 3 / 4 of its norm, the window means by
    0.5 along one of D = 4 elements where the drawn noise is 1 per element (s^2 = 1: KL 0.5^2 / 2 = 0.125 for that
    transition), a log-prob by 0.25."""
    D = 4
    window = torch.tensor([[0, 1], [2, 3]])
    x_t = torch.ones(2, 2, D)
    mean = torch.zeros(2, 2, D)
    x_next = mean + 1.0  # noise of 1 in every element: s^2 = 1
    x0 = torch.tensor([[4.0, 0, 0, 0], [0, 2.0, 0, 0]])
    log_prob = torch.zeros(2, 2)
    ref = SimpleNamespace(window=window, x_t=x_t, x_next=x_next, mean=mean, x0=x0, log_prob=log_prob)
    moved_x_t = x_t.clone()
    moved_x_t[1, 0, 0] += 1.0  # ||(1,0,0,0)|| / ||(1,1,1,1)|| = 1 / 2
    moved_mean = mean.clone()
    moved_mean[1, 1, 2] = 0.5
    moved_x0 = x0.clone()
    moved_x0[0, 0] = 1.0  # 3 / 4 for sample 0, 0 for sample 1
    moved_lp = log_prob.clone()
    moved_lp[0, 1] = -0.25
    traj = SimpleNamespace(
        window=window, x_t=moved_x_t, x_next=x_next, mean=moved_mean, x0=moved_x0, log_prob=moved_lp
    )
    dev = train_step.rollout_deviation(traj, ref)
    assert dev["prefix"] == {2: 0.5}  # the sample whose window starts at step 0 has no prefix
    assert dev["x0"] == pytest.approx(3 / 8)
    assert dev["kl"] == pytest.approx(0.125 / 4)  # the mean over 2 samples x 2 window steps
    assert dev["log_prob"] == 0.25
    assert train_step.rollout_deviation(ref, ref) == {
        "prefix": {2: 0.0},
        "x0": 0.0,
        "kl": 0.0,
        "log_prob": 0.0,
    }


FAKE_SERVER = [sys.executable, str(ROOT / "tests" / "fake_openai_server.py")]


def test_vllm_server_waits_for_the_server_and_reports_one_that_exits(bench, tmp_path):
    """VllmServer starts its command with the port, waits for GET /v1/models, kills the whole group; a server that
    exits before serving is a RuntimeError with its console's tail."""
    vlm_model = bench("vlm_model")
    server = vlm_model.VllmServer(tmp_path / "m", tmp_path / "ok.log", command=FAKE_SERVER)
    try:
        assert server.wait(timeout_s=60) < 60
        assert server.proc.poll() is None and "serving" in server.tail()
    finally:
        server.kill()
    assert server.proc.returncode == -9
    failing = vlm_model.VllmServer(tmp_path / "m", tmp_path / "bad.log", command=[*FAKE_SERVER, "--exit"])
    with pytest.raises(RuntimeError, match=r"exited \(3\) before serving; the errors") as err:
        failing.wait(timeout_s=60)
    # the root cause, 40 lines above the end and so outside the tail, is named first
    head, tail = str(err.value).split("\n", 1)
    assert head.endswith(
        "the errors in its console: ModuleNotFoundError: No module named 'x' | RuntimeError: Engine core "
        "initialization failed. See root cause above.; its last lines:"
    )
    assert "ModuleNotFoundError" not in tail and tail.endswith("fake server: failing to start")


def _live_members(pgid: int) -> list[int]:
    """The processes of group `pgid` that run (zombies, whose parent has not reaped them yet, left out)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue  # gone while listing
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


@pytest.mark.skipif(sys.platform != "linux", reason="the server's leash is Linux's PR_SET_PDEATHSIG")
def test_the_vllm_server_dies_with_the_process_that_started_it(tmp_path):
    """A trainer killed outright (SIGKILL: none of its code runs, as under a timeout's kill or an OOM killer)
    takes its server's whole process group along, the server and the process the server started, instead of
    leaving them to hold their share of the GPU."""
    started = tmp_path / "started"
    server = (  # a server that starts a worker of its own, as vLLM's API server starts its engine core
        "import pathlib, subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"pathlib.Path({str(started)!r}).touch(); time.sleep(120)"
    )
    starter = tmp_path / "starter.py"
    starter.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "import vlm_model\n"
        f"s = vlm_model.VllmServer({str(tmp_path / 'm')!r}, {str(tmp_path / 'log')!r}, "
        f"command=[sys.executable, '-c', {server!r}])\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, str(starter)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pgid = int(proc.stdout.readline())  # the server's supervisor leads its own group
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        # the server and its worker (and, with the leash, the supervisor)
        assert len(_live_members(pgid)) >= 2
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while _live_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _live_members(pgid) == []
    finally:
        proc.kill()
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_vllm_server_turns_the_flashinfer_sampler_off_only_without_flashinfer(bench, monkeypatch):
    """vLLM 0.30 fails to start where flashinfer is missing unless its FlashInfer sampler is off: the server's
    environment turns it off then, keeps it where flashinfer is installed, and keeps a value the caller set."""
    import importlib.util

    vlm_model = bench("vlm_model")
    real_find_spec = importlib.util.find_spec
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    for installed in (False, True):
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a, installed=installed: (
                (object() if installed else None) if name == "flashinfer" else real_find_spec(name, *a)
            ),
        )
        env = vlm_model.serve_env()
        assert env.get("VLLM_USE_FLASHINFER_SAMPLER") == (None if installed else "0")
        assert env["PATH"] == os.environ["PATH"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    assert vlm_model.serve_env()["VLLM_USE_FLASHINFER_SAMPLER"] == "1"


def test_the_vllm_server_takes_one_image_a_prompt_of_at_most_a_megapixel(bench):
    """vLLM profiles its memory with the largest input a prompt may hold: one image of at most 1 MP (1337 visual
    tokens, inside --max-model-len) and no video, not the processor's 16384-token bound."""
    import json

    argv = bench("vlm_model").serve_argv("/ckpt", 8123, 0.1, 4096, eager=False)
    flags = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and flags["--model"] == "/ckpt"
    assert json.loads(flags["--limit-mm-per-prompt"]) == {"image": 1, "video": 0}
    max_pixels = json.loads(flags["--mm-processor-kwargs"])["max_pixels"]
    assert max_pixels // (28 * 28) < int(flags["--max-model-len"])
    assert (flags["--port"], flags["--gpu-memory-utilization"]) == ("8123", "0.1")


def test_train_step_served_vlm_reward_and_a_server_killed_mid_step(bench, train_step, monkeypatch, capsys):
    """--reward vlm-served: the tiny VLM is written, its server started before the model is built and read through
    fgrpo's OpenAI client, streamed (here a fake server that answers "WORD" after 0.3 s); --kill-server-at: the
    step after the timed ones loses its server mid-way and stops with the client's one-line error, not a hang."""
    vlm_model = bench("vlm_model")
    started = []

    class Fake(vlm_model.VllmServer):
        def __init__(self, path, log, **kw):
            super().__init__(path, log, command=[*FAKE_SERVER, "--delay", "0.3"], **kw)
            started.append(self)

    monkeypatch.setattr(vlm_model, "VllmServer", Fake)
    monkeypatch.setattr(vlm_model, "write_random_vlm", lambda path, *a, **k: Path(path).mkdir(parents=True))
    args = ["--reward", "vlm-served", "--reward-stream", "--kill-server-at", "0.1", *TRAIN_ARGS]
    out = run_main(train_step, monkeypatch, capsys, *args)
    (server,) = started
    assert server.path.name == "qwen2_5_vl_tiny" and not server.path.parent.exists()  # temporary: removed
    assert re.search(
        r"^\| reward \(random Qwen2.5-VL OCR, served by vLLM, streamed: the wait\) \|", out, re.M
    )
    kill = re.search(r"^# the VLM server killed 0.1 s into step 1: the step raised (.*); it ended", out, re.M)
    assert kill is not None and kill.group(1).startswith("RewardServiceError: VLM server http://127.0.0.1")
    assert "unreachable" in kill.group(1) or "HTTP" in kill.group(1)
