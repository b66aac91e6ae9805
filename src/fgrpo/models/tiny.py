"""Tiny random-init Qwen-Image, SD3, FLUX.1, FLUX.2 [klein] and [dev], Z-Image, LTX-2 and Wan 2.2 (every component,
tokenizers included), built offline in code.

Same diffusers / transformers classes as the real models, shrunk until a 64x64 denoising step takes
milliseconds on a CPU. Used by the tests (parity with diffusers' own pipelines), the experiments' tiny
presets, and, saved as a diffusers pipeline directory, by the vLLM-Omni engine's GPU tests.

The tokenizers are byte-level BPEs trained here, in code, on the prompt template, so no file is
downloaded. Qwen-Image's tokenizer is built with Qwen's own pre-tokenizer and learns every word of
the chat template as one token: the template's system/user prefix is then exactly 34 tokens, as with
the real tokenizer, so the pipeline's hard-coded "drop the first 34 tokens" means the same thing here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
    T5Config,
    T5EncoderModel,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from fgrpo.models import flux, flux2, ltx2, qwen_image, sd3, zimage
from fgrpo.models.bagel import Bagel
from fgrpo.models.bagel_mot import BagelTransformer
from fgrpo.models.flux import Flux
from fgrpo.models.flux2 import Flux2
from fgrpo.models.ltx2 import LTX2
from fgrpo.models.qwen_image import PROMPT_DROP, PROMPT_TEMPLATE, QwenImage
from fgrpo.models.qwen_image_edit import EDIT_PROMPT_DROP, EDIT_PROMPT_TEMPLATE, QwenImageEdit
from fgrpo.models.qwen_vl import vl_processor
from fgrpo.models.sd3 import CLIP_MAX_LENGTH, SD3
from fgrpo.models.wan import Wan
from fgrpo.models.zimage import ZImage

# Words the tiny BPEs learn besides the template (tests' prompts tokenise into fewer, longer tokens).
_EXTRA_TEXT = "a photo of a cat holding a sign that says hello world, a red square on a blue background"
T5_MAX_LENGTH_TINY = 32
# Qwen2.5-VL's vision tokens: the image placeholder (in template order), and the video one, which the processor
# counts in every text (without it in the vocabulary, the padding token would be counted as video).
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
# The tiny edit model's condition images are about 64x64 (the pipeline's 1024² would be 4096 tokens a row).
TINY_CONDITION_AREA = 64 * 64
# The tiny LTX-2's prompt length (Gemma's 1024 would be most of a CPU step) and default clip.
TINY_LTX2_TEXT_LENGTH = 16
TINY_LTX2_CLIP = {"num_frames": 9, "frame_rate": 24.0, "height": 32, "width": 32}


def _train_bpe(text: str, specials: list[str], pre_tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE (vocab, merges) that learns every word of `text` whole; deterministic."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.add_special_tokens(specials)  # split out of the text exactly as at use time
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], [tuple(m) for m in model["merges"]]


# Qwen3's chat template for the tiny tokenizers' apply_chat_template: one user turn and the generation prompt, plus
# the empty think block when thinking is off (FLUX.2 [klein] turns it off, Z-Image leaves it on); the real tokenizers
# ship their own, which the models apply the same way.
QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tiny_qwen_tokenizer(template: str = PROMPT_TEMPLATE, drop: int = PROMPT_DROP) -> Qwen2Tokenizer:
    """Qwen2Tokenizer (Qwen's pre-tokenizer) with a tiny byte-level vocabulary and the chat special tokens
    (and the vision ones where `template` holds an image placeholder), whose split of the template's
    system/user prefix is `drop` tokens, as with Qwen's real tokenizer."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    specials += list(VISION_TOKENS) if VISION_TOKENS[0] in template else []
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    vocab, merges = _train_bpe(template.format(_EXTRA_TEXT), specials, pre)
    # transformers annotates merges as list[str]; its tokenizers backend takes the (a, b) pairs we pass.
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)  # pyright: ignore[reportArgumentType]
    tok.add_special_tokens({"additional_special_tokens": specials[1:]})
    prefix = template.split("{}")[0].split(VISION_TOKENS[0])[0]
    n = len(tok(prefix)["input_ids"])
    if n != drop:  # the whole point of training on the template; fail loudly if tokenizers changes
        raise RuntimeError(f"tiny Qwen tokenizer splits the template prefix into {n} tokens, expected {drop}")
    return tok


def _tiny_fast_tokenizer(bos: str | None, eos: str, pad: str, max_length: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE with `[bos] text eos` post-processing (stands in for CLIP's and T5's tokenizers)."""
    specials = [s for s in dict.fromkeys([pad, eos, bos]) if s is not None]
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    vocab, merges = _train_bpe(_EXTRA_TEXT, specials, pre)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    single = f"{bos} $A {eos}" if bos else f"$A {eos}"
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(s, vocab[s]) for s in specials if s in (bos, eos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, model_max_length=max_length
    )


def tiny_clip_tokenizer() -> PreTrainedTokenizerFast:
    return _tiny_fast_tokenizer("<|startoftext|>", "<|endoftext|>", "<|endoftext|>", CLIP_MAX_LENGTH)


def tiny_t5_tokenizer() -> PreTrainedTokenizerFast:
    return _tiny_fast_tokenizer(None, "</s>", "<pad>", T5_MAX_LENGTH_TINY)


# ----------------------------------------------------------------------------------------------------
# Qwen-Image


def _tiny_clip(
    tokenizer: PreTrainedTokenizerFast, hidden: int, *, projection: bool = False
) -> torch.nn.Module:
    """A two-layer CLIP text encoder of width `hidden` (with a projection of the same width for SD3's pooled
    features), on the tiny CLIP tokenizer's ids."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=CLIP_MAX_LENGTH,
        projection_dim=hidden,
        # ints here; transformers types a tokenizer's *_token_id as int | str | list | None
        bos_token_id=tokenizer.bos_token_id,  # pyright: ignore[reportArgumentType]
        eos_token_id=tokenizer.eos_token_id,  # pyright: ignore[reportArgumentType]
        pad_token_id=tokenizer.pad_token_id,  # pyright: ignore[reportArgumentType]
    )
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def _tiny_t5(tokenizer: PreTrainedTokenizerFast, width: int) -> T5EncoderModel:
    """A two-layer T5 encoder of width `width` on the tiny T5 tokenizer's ids."""
    return T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=width,
            d_kv=8,
            d_ff=32,
            num_layers=2,
            num_heads=4,
            pad_token_id=tokenizer.pad_token_id,  # pyright: ignore[reportArgumentType]
            eos_token_id=tokenizer.eos_token_id,  # pyright: ignore[reportArgumentType]
        )
    )


def _tiny_vae(scaling_factor: float, shift_factor: float) -> AutoencoderKL:
    """A 4-channel AutoencoderKL (8x down, 64x64 images) with the given latent scale and shift."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        # diffusers annotates these as tuple[str] / tuple[int] (one element); any length is meant
        down_block_types=("DownEncoderBlock2D",) * 4,  # pyright: ignore[reportArgumentType]
        up_block_types=("UpDecoderBlock2D",) * 4,  # pyright: ignore[reportArgumentType]
        block_out_channels=(8, 8, 16, 16),  # pyright: ignore[reportArgumentType]
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def tiny_qwen_image_components(seed: int = 0, *, tokenizer: Qwen2Tokenizer | None = None) -> dict:
    """Random-init tiny Qwen-Image parts, keyed like QwenImagePipeline's constructor (fp32, CPU)."""
    tokenizer = tokenizer or tiny_qwen_tokenizer()
    vocab = len(tokenizer)
    # Qwen2.5-VL finds an image's tokens by these ids; only a tokenizer with the vision tokens has them.
    names = ("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id")
    vocab_ids = tokenizer.get_vocab()
    vision_ids = {n: vocab_ids[t] for n, t in zip(names, VISION_TOKENS) if t in vocab_ids}
    hidden = 32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_config = dict(
            hidden_size=hidden,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            rope_scaling={"mrope_section": [2, 2, 4], "rope_type": "default", "type": "default"},
            rope_theta=1e6,
            vocab_size=vocab,
            bos_token_id=None,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        )
        vision_config = dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden
        )
        # pyright matches a ** dict against every keyword; these are the int token ids
        config = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, **vision_ids)  # pyright: ignore[reportArgumentType]
        text_encoder = Qwen2_5_VLForConditionalGeneration(config)
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=hidden,
            axes_dims_rope=(4, 6, 6),
        )
        z = 4
        # Non-trivial latent statistics, so a wrong (de)normalisation cannot pass the parity tests.
        vae = AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=z,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=(torch.randn(z) * 0.3).tolist(),
            latents_std=(torch.rand(z) + 0.5).tolist(),
        )
    for m in (text_encoder, transformer, vae):
        m.eval()
    return dict(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(qwen_image.SCHEDULER_CONFIG),
    )


def tiny_qwen_image(
    seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kwargs
) -> QwenImage:
    """A tiny random Qwen-Image FlowModel (64x64 images take a few ms per step on a CPU)."""
    c = tiny_qwen_image_components(seed)
    if dtype != torch.float32:
        c["transformer"].to(dtype)
    return QwenImage.from_modules(
        c["transformer"], c["vae"], c["text_encoder"], c["tokenizer"], device=device, **kwargs
    )


def save_tiny_qwen_image(path: str | Path, seed: int = 0) -> Path:
    """Write a diffusers-format pipeline directory (model_index.json, one subfolder per component).

    QwenImagePipeline.from_pretrained(path) and vLLM-Omni load it like the real Qwen/Qwen-Image.
    """
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

    path = Path(path)
    QwenImagePipeline(**tiny_qwen_image_components(seed)).save_pretrained(path)
    return path


def tiny_qwen_image_edit_components(seed: int = 0) -> dict:
    """Random-init tiny Qwen-Image-Edit parts, keyed like QwenImageEditPipeline's constructor (fp32, CPU): the
    tiny Qwen-Image modules over a tokenizer that knows the edit template and the vision tokens, and a
    Qwen2-VL processor whose images stay small (a 64² condition image becomes 4 VL tokens)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = tiny_qwen_tokenizer(EDIT_PROMPT_TEMPLATE, EDIT_PROMPT_DROP)
    parts = tiny_qwen_image_components(seed, tokenizer=tokenizer)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56)
    parts["processor"] = vl_processor(image_processor, tokenizer)
    return parts


def tiny_qwen_image_edit(
    seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kwargs
) -> QwenImageEdit:
    """A tiny random Qwen-Image-Edit FlowModel; condition images are resized to about 64² (TINY_CONDITION_AREA)."""
    c = tiny_qwen_image_edit_components(seed)
    if dtype != torch.float32:
        c["transformer"].to(dtype)
    kwargs.setdefault("condition_area", TINY_CONDITION_AREA)
    return QwenImageEdit.from_modules(
        c["transformer"],
        c["vae"],
        c["text_encoder"],
        c["tokenizer"],
        processor=c["processor"],
        device=device,
        **kwargs,
    )


# ----------------------------------------------------------------------------------------------------
# SD3


def tiny_sd3_components(seed: int = 0) -> dict:
    """Random-init tiny SD3 parts, keyed like StableDiffusion3Pipeline's constructor (fp32, CPU)."""
    clip_tok, t5_tok = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    joint = 32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # CLIP widths 8 + 16 < T5's 32, so the pipeline's zero-padding of the CLIP features is exercised.
        clip_l, clip_g = _tiny_clip(clip_tok, 8, projection=True), _tiny_clip(clip_tok, 16, projection=True)
        t5 = _tiny_t5(t5_tok, joint)
        transformer = SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=joint,
            caption_projection_dim=16,
            pooled_projection_dim=8 + 16,
            out_channels=4,
            qk_norm="rms_norm",
            dual_attention_layers=(0,),  # SD3.5 Medium's MMDiT-X block, in miniature
        )
        vae = _tiny_vae(scaling_factor=1.5305, shift_factor=0.0609)
    for m in (clip_l, clip_g, t5, transformer, vae):
        m.eval()
    return dict(
        transformer=transformer,
        vae=vae,
        text_encoder=clip_l,
        text_encoder_2=clip_g,
        text_encoder_3=t5,
        tokenizer=clip_tok,
        tokenizer_2=clip_tok,
        tokenizer_3=t5_tok,
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(sd3.SCHEDULER_CONFIG),
    )


def tiny_sd3(
    seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kwargs
) -> SD3:
    """A tiny random SD3.5-style FlowModel (64x64 images take a few ms per step on a CPU)."""
    c = tiny_sd3_components(seed)
    if dtype != torch.float32:
        c["transformer"].to(dtype)
    encoders = [c["text_encoder"], c["text_encoder_2"], c["text_encoder_3"]]
    tokenizers = [c["tokenizer"], c["tokenizer_2"], c["tokenizer_3"]]
    kwargs.setdefault("max_sequence_length", T5_MAX_LENGTH_TINY)
    return SD3.from_modules(c["transformer"], c["vae"], encoders, tokenizers, device=device, **kwargs)


# ----------------------------------------------------------------------------------------------------
# FLUX.1


def tiny_flux_components(seed: int = 0) -> dict:
    """Random-init tiny FLUX.1-dev parts, keyed like FluxPipeline's constructor (fp32, CPU): the guidance embedding
    on (FLUX.1-dev's), one joint and two single-stream blocks, a 4-channel VAE with FLUX's latent scale and shift."""
    clip_tok, t5_tok = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    joint, pooled = 32, 16
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = _tiny_clip(clip_tok, pooled)
        t5 = _tiny_t5(t5_tok, joint)
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,  # 4 latent channels x the pipeline's 2x2 packing
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=joint,
            pooled_projection_dim=pooled,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        )
        vae = _tiny_vae(
            scaling_factor=0.3611, shift_factor=0.1159
        )  # black-forest-labs/FLUX.1-dev's vae/config.json
    for m in (clip, t5, transformer, vae):
        m.eval()
    return dict(
        transformer=transformer,
        vae=vae,
        text_encoder=clip,
        text_encoder_2=t5,
        tokenizer=clip_tok,
        tokenizer_2=t5_tok,
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(flux.SCHEDULER_CONFIG),
    )


def tiny_flux(
    seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kwargs
) -> Flux:
    """A tiny random FLUX.1-dev FlowModel (64x64 images take a few ms per step on a CPU)."""
    c = tiny_flux_components(seed)
    if dtype != torch.float32:
        c["transformer"].to(dtype)
    kwargs.setdefault("max_sequence_length", T5_MAX_LENGTH_TINY)
    return Flux.from_modules(
        c["transformer"],
        c["vae"],
        [c["text_encoder"], c["text_encoder_2"]],
        [c["tokenizer"], c["tokenizer_2"]],
        device=device,
        **kwargs,
    )


# ----------------------------------------------------------------------------------------------------
# Z-Image


def tiny_zimage_components(seed: int = 0) -> dict:
    """Random-init tiny Z-Image parts, keyed like ZImagePipeline's constructor (fp32, CPU): a two-layer Qwen3 causal
    LM (the conditioning is its second-to-last hidden layer), a transformer of one refiner block each and two main
    blocks, a 4-channel VAE with a latent scale and shift."""
    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    text_dim = 32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=len(tokenizer),
                hidden_size=text_dim,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                max_position_embeddings=1024,
            )
        )
        transformer = ZImageTransformer2DModel(
            in_channels=4,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            cap_feat_dim=text_dim,
            axes_dims=[8, 4, 4],  # sums to the head size, 16
            axes_lens=[256, 64, 64],
        )
        vae = _tiny_vae(scaling_factor=0.3611, shift_factor=0.1159)
    for m in (text_encoder, transformer, vae):
        m.eval()
    return dict(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(zimage.SCHEDULER_CONFIG),
    )


def tiny_zimage(
    seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kwargs
) -> ZImage:
    """A tiny random Z-Image FlowModel (64x64 images take a few ms per step on a CPU)."""
    c = tiny_zimage_components(seed)
    if dtype != torch.float32:
        c["transformer"].to(dtype)
    return ZImage.from_modules(
        c["transformer"], c["vae"], c["text_encoder"], c["tokenizer"], device=device, **kwargs
    )


# ----------------------------------------------------------------------------------------------------
# LTX-2


def tiny_gemma_tokenizer(max_length: int = TINY_LTX2_TEXT_LENGTH) -> PreTrainedTokenizerFast:
    """A byte-level BPE with Gemma's <bos> ... <eos> framing and <pad> (stands in for Gemma 3's tokenizer)."""
    return _tiny_fast_tokenizer("<bos>", "<eos>", "<pad>", max_length)


def tiny_ltx2_components(seed: int = 0) -> dict:
    """Random-init tiny LTX-2.3 parts, keyed like LTX2Pipeline's constructor (fp32, CPU).

    The LTX-2.3 switches are on (gated attention, prompt modulation from sigma, per-modality text projections,
    learnable registers), so the tiny model runs the same code paths as the real one. The VAE compresses 8x in
    space and 2x in time (the real one 32x and 8x), so a 32x32, 9-frame clip is 5 x 4 x 4 video tokens.
    """
    from diffusers.models.autoencoders.autoencoder_kl_ltx2 import AutoencoderKLLTX2Video
    from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import AutoencoderKLLTX2Audio
    from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = tiny_gemma_tokenizer()
    hidden, layers = 32, 2
    video_ch, audio_ch, mel_bins = 8, 2, 16  # audio tokens: 2 channels x 16 / 4 latent mel bins = 8 features
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Gemma3ForConditionalGeneration(
            Gemma3Config(
                text_config=dict(
                    hidden_size=hidden,
                    intermediate_size=64,
                    num_hidden_layers=layers,
                    num_attention_heads=2,
                    num_key_value_heads=1,
                    head_dim=16,
                    vocab_size=len(tokenizer),
                    sliding_window=8,
                    pad_token_id=tokenizer.pad_token_id,
                    bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                ),
                vision_config=dict(
                    hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                    patch_size=14,
                ),
                mm_tokens_per_image=4,
            )
        )  # fmt: skip
        connectors = LTX2TextConnectors(
            caption_channels=hidden,
            text_proj_in_factor=layers + 1,  # every hidden state, the embedding layer's included
            video_connector_num_attention_heads=4,
            video_connector_attention_head_dim=8,
            video_connector_num_layers=1,
            video_connector_num_learnable_registers=8,
            audio_connector_num_attention_heads=4,
            audio_connector_attention_head_dim=8,
            audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=8,
            connector_rope_base_seq_len=32,
            rope_double_precision=False,
            rope_type="split",
            per_modality_projections=True,
            video_hidden_dim=hidden,
            audio_hidden_dim=hidden,
        )
        transformer = LTX2VideoTransformer3DModel(
            in_channels=video_ch,
            out_channels=video_ch,
            num_attention_heads=2,
            attention_head_dim=8,
            cross_attention_dim=16,
            vae_scale_factors=(2, 8, 8),
            gated_attn=True,
            cross_attn_mod=True,
            audio_in_channels=audio_ch * mel_bins // 4,
            audio_out_channels=audio_ch * mel_bins // 4,
            audio_num_attention_heads=2,
            audio_attention_head_dim=4,
            audio_cross_attention_dim=8,
            audio_gated_attn=True,
            audio_cross_attn_mod=True,
            num_layers=2,
            caption_channels=hidden,
            rope_double_precision=False,
            rope_type="split",
        )
        vae = AutoencoderKLLTX2Video(
            latent_channels=video_ch,
            block_out_channels=(8,),
            decoder_block_out_channels=(8,),
            layers_per_block=(1, 1),
            decoder_layers_per_block=(1, 1),
            spatio_temporal_scaling=(True,),
            decoder_spatio_temporal_scaling=(True,),
            decoder_inject_noise=(False, False),
            downsample_type=("spatiotemporal",),
            upsample_type=("spatiotemporal",),
            upsample_residual=(False,),
            upsample_factor=(1,),
            patch_size=4,
            decoder_causal=False,
        )
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=audio_ch * mel_bins // 4,  # its latent statistics are per packed audio feature
            output_channels=2,
            ch_mult=(1,),
            num_res_blocks=1,
            resolution=32,
            latent_channels=audio_ch,
            mel_bins=mel_bins,
        )
        vocoder = LTX2Vocoder(
            in_channels=2 * mel_bins,
            hidden_channels=32,
            upsample_kernel_sizes=[4, 4],
            upsample_factors=[2, 2],
            resnet_kernel_sizes=[3],
            resnet_dilations=[[1, 3, 5]],
            output_sampling_rate=16000,
        )
        # Non-trivial latent statistics, so a wrong (de)normalisation cannot pass the parity tests.
        for v in (vae, audio_vae):
            v.latents_mean.copy_(torch.randn_like(v.latents_mean) * 0.3)
            v.latents_std.copy_(torch.rand_like(v.latents_std) + 0.5)
    for m in (text_encoder, connectors, transformer, vae, audio_vae, vocoder):
        m.eval()
    return dict(
        transformer=transformer,
        vae=vae,
        audio_vae=audio_vae,
        vocoder=vocoder,
        connectors=connectors,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(ltx2.SCHEDULER_CONFIG),
    )


def tiny_ltx2(
    seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kwargs
) -> LTX2:
    """A tiny random LTX-2.3 FlowModel: by default a 32x32, 9-frame clip at 24 fps (5 x 4 x 4 video tokens and 9
    audio tokens; a denoising step with CFG on 3 clips takes ~0.2 s on a busy 2-core CPU)."""
    c = tiny_ltx2_components(seed)
    if dtype != torch.float32:
        c["transformer"].to(dtype)
    for k, v in TINY_LTX2_CLIP.items():
        kwargs.setdefault(k, v)
    kwargs.setdefault("max_sequence_length", TINY_LTX2_TEXT_LENGTH)
    return LTX2.from_modules(**{k: c[k] for k in ltx2.MODULES}, device=device, **kwargs)


# ----------------------------------------------------------------------------------------------------
# FLUX.2 [klein]

# Qwen3's chat template as Flux2KleinPipeline renders it (one user turn, generation prompt, thinking off)
FLUX2_PROMPT_TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
FLUX2_TEXT_LENGTH_TINY = 24
FLUX2_TEXT_LAYERS_TINY = (1, 2, 3)


def _tiny_flux2_image_parts(text_width: int, guidance_embeds: bool) -> dict:
    """The tiny FLUX.2 transformer (one joint and two single-stream blocks reading `text_width`-wide text states) and
    a 4-channel VAE whose batch-norm statistics are random (so the normalisation is exercised); draws from torch's
    global generator."""
    from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel(
        in_channels=16,  # 4 latent channels x the 2x2 patchify
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_width,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=64,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    bn: Any = vae.bn  # BatchNorm2d annotates its running statistics as optional
    bn.running_mean.normal_(0, 0.5)
    bn.running_var.uniform_(0.5, 2.0)
    return dict(transformer=transformer, vae=vae)


def _flux2_components(parts: dict, text_encoder: torch.nn.Module, tokenizer: Any) -> dict:
    """A tiny FLUX.2's parts in eval mode, with its text encoder, tokenizer (or processor) and scheduler, keyed like
    the pipeline's constructor."""
    for m in (text_encoder, *parts.values()):
        m.eval()
    return dict(
        **parts,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(flux2.SCHEDULER_CONFIG),
    )


def tiny_flux2_components(seed: int = 0, text_depth: int = 0) -> dict:
    """Random-init tiny FLUX.2 [klein] parts, keyed like Flux2KleinPipeline's constructor (fp32, CPU): a 3-layer
    Qwen3 (every layer's states stacked), the tiny FLUX.2 transformer without a guidance embedding, the tiny VAE.
    text_depth: the Qwen3's layers instead of 3 (its states are still read at 3 layers; a directory that vLLM-Omni
    loads needs the released layers, 9 / 18 / 27, for the start-up request it sends without fgrpo's keywords)."""
    tokenizer = tiny_qwen_tokenizer(FLUX2_PROMPT_TEMPLATE, drop=3)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    hidden = 16
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=len(tokenizer),
                hidden_size=hidden,
                intermediate_size=32,
                num_hidden_layers=text_depth or len(FLUX2_TEXT_LAYERS_TINY),
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=8,
                max_position_embeddings=128,
                pad_token_id=tokenizer.pad_token_id,  # pyright: ignore[reportArgumentType]
            )
        )
        parts = _tiny_flux2_image_parts(
            hidden * len(FLUX2_TEXT_LAYERS_TINY), guidance_embeds=False
        )  # klein's
    return _flux2_components(parts, text_encoder, tokenizer)


def tiny_flux2(
    seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kwargs
) -> Flux2:
    """A tiny random FLUX.2 [klein] base FlowModel (true CFG; 64x64 images take a few ms per step on a CPU)."""
    kwargs.setdefault("max_sequence_length", FLUX2_TEXT_LENGTH_TINY)
    return _tiny_flux2_model(tiny_flux2_components(seed), device, dtype, **kwargs)


def _tiny_flux2_model(c: dict, device: torch.device | str, dtype: torch.dtype, **kwargs) -> Flux2:
    """A tiny FLUX.2 (klein or dev) FlowModel from its components, the transformer in `dtype`."""
    if dtype != torch.float32:
        c["transformer"].to(dtype)
    kwargs.setdefault("text_layers", FLUX2_TEXT_LAYERS_TINY)
    return Flux2.from_modules(
        c["transformer"], c["vae"], c["text_encoder"], c["tokenizer"], device=device, **kwargs
    )


# ----------------------------------------------------------------------------------------------------
# FLUX.2 [dev]

# A Mistral-style chat template for the tiny processor: the bos token, then [SYSTEM_PROMPT]...[/SYSTEM_PROMPT] and
# [INST]...[/INST] turns whose content is a list of typed parts (the text parts joined), as Flux2Pipeline passes
# them; the real processor ships its own, which the model applies the same way.
MISTRAL3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['content'] is string %}{% set text = m['content'] %}"
    "{% else %}{% set text = m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% endif %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)
MISTRAL3_SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
]
PIXTRAL_IMAGE_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]  # the processor looks their ids up
# The system message takes 30 tokens of the tiny vocabulary, a tests' prompt up to 12 more with the turn markers.
FLUX2_DEV_TEXT_LENGTH_TINY = 48


def tiny_mistral3_processor():
    """PixtralProcessor (Mistral-3's) around a byte-level BPE that learns Flux2Pipeline's system message and the
    tests' words whole, with Mistral's turn and image special tokens and the chat template above."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import PixtralProcessor
    from transformers.models.pixtral.image_processing_pixtral import PixtralImageProcessor

    specials = MISTRAL3_SPECIALS + PIXTRAL_IMAGE_TOKENS
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    vocab, merges = _train_bpe(f"{SYSTEM_MESSAGE} {_EXTRA_TEXT}", specials, pre)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    return PixtralProcessor(
        image_processor=PixtralImageProcessor(), tokenizer=fast, chat_template=MISTRAL3_CHAT_TEMPLATE
    )


def tiny_flux2_dev_components(seed: int = 0, text_depth: int = 0) -> dict:
    """Random-init tiny FLUX.2 [dev] parts, keyed like Flux2Pipeline's constructor (fp32, CPU): a Mistral-3 with a
    3-layer Mistral language model (every layer's states stacked) and a 1-layer Pixtral vision tower, its processor,
    the tiny FLUX.2 transformer with a guidance embedding, the tiny VAE. The LM head is a copy of the embedding, not
    tied to it (the released model's is its own; vLLM-Omni's loader requires it). text_depth: as
    tiny_flux2_components' (the released layers here: 10 / 20 / 30)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    processor = tiny_mistral3_processor()
    tokenizer: Any = processor.tokenizer
    hidden = 16
    config = Mistral3Config(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=32,
            num_hidden_layers=text_depth or len(FLUX2_TEXT_LAYERS_TINY),
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=128,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=8,
            patch_size=4,
            image_size=32,
        ),  # fmt: skip
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Mistral3ForConditionalGeneration(config)
        parts = _tiny_flux2_image_parts(hidden * len(FLUX2_TEXT_LAYERS_TINY), guidance_embeds=True)  # dev's
    # untied after the draws, so the weights are those of the tied model
    text_encoder.lm_head.weight = torch.nn.Parameter(text_encoder.lm_head.weight.detach().clone())
    text_encoder.config.tie_word_embeddings = False
    text_encoder.config.get_text_config().tie_word_embeddings = False
    return _flux2_components(parts, text_encoder, processor)


def tiny_flux2_dev(
    seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kwargs
) -> Flux2:
    """A tiny random FLUX.2 [dev] FlowModel (embedded guidance, one forward a step; 64x64 images take a few ms per
    step on a CPU)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    kwargs.setdefault("max_sequence_length", FLUX2_DEV_TEXT_LENGTH_TINY)
    kwargs.setdefault("system_message", SYSTEM_MESSAGE)
    return _tiny_flux2_model(tiny_flux2_dev_components(seed), device, dtype, **kwargs)


# ----------------------------------------------------------------------------------------------------
# Wan 2.2

# The tiny Wan's prompt length (WanPipeline's 512 would be most of a CPU step), clip length and flow shift (ours).
TINY_WAN_TEXT_LENGTH = 16
TINY_WAN_FRAMES = 5
TINY_WAN_FLOW_SHIFT = 3.0
# T2V-A14B's model_index.json boundary (the tiny two-expert model's; the tests pick steps on both sides of it).
TINY_WAN_BOUNDARY_RATIO = 0.875


def tiny_wan_components(seed: int = 0, *, experts: int = 1) -> dict:
    """Random-init tiny Wan 2.2 parts, keyed like WanPipeline's constructor (fp32, CPU): a 2-layer UMT5, one
    transformer (TI2V-5B-like: the Wan 2.2 VAE, patchified 2x2 inside it, 16x spatial and 4x temporal compression,
    expand_timesteps) or two experts with a boundary (T2V-A14B-like: the Wan 2.1 VAE, 8x and 4x). The VAE's latent
    mean and std are random, so a wrong de-normalisation cannot pass the parity tests."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    if experts not in (1, 2):
        raise ValueError(f"experts={experts}: Wan has 1 (TI2V-5B) or 2 (T2V-A14B)")
    tokenizer = _tiny_fast_tokenizer(None, "</s>", "<pad>", TINY_WAN_TEXT_LENGTH)
    text_dim, z_dim = 32, 4
    g = torch.Generator().manual_seed(seed + 1)
    stats: dict[str, Any] = dict(
        latents_mean=(torch.randn(z_dim, generator=g) * 0.3).tolist(),
        latents_std=(torch.rand(z_dim, generator=g) + 0.5).tolist(),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(tokenizer),
                d_model=text_dim,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=tokenizer.pad_token_id,  # pyright: ignore[reportArgumentType]
                eos_token_id=tokenizer.eos_token_id,  # pyright: ignore[reportArgumentType]
            )
        )

        def transformer() -> WanTransformer3DModel:
            return WanTransformer3DModel(
                patch_size=(1, 2, 2),
                num_attention_heads=2,
                attention_head_dim=8,
                in_channels=z_dim,
                out_channels=z_dim,
                text_dim=text_dim,
                freq_dim=32,
                ffn_dim=32,
                num_layers=2,
                rope_max_seq_len=32,
            )

        if (
            experts == 1
        ):  # the Wan 2.2 VAE: residual blocks, a 2x2 patchify of its own (12 = 3 x 2 x 2 channels)
            vae = AutoencoderKLWan(
                base_dim=8, z_dim=z_dim, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                dim_mult=[1, 1, 1, 1], temperal_downsample=[False, True, True], scale_factor_spatial=16,
                scale_factor_temporal=4, **stats,
            )  # fmt: skip
        else:
            vae = AutoencoderKLWan(
                base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1], temperal_downsample=[False, True, True], **stats
            )  # fmt: skip
        experts_ = [transformer() for _ in range(experts)]
    for m in (text_encoder, vae, *experts_):
        m.eval()
    return dict(
        transformer=experts_[0],
        transformer_2=experts_[1] if experts == 2 else None,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=TINY_WAN_FLOW_SHIFT),
        boundary_ratio=TINY_WAN_BOUNDARY_RATIO if experts == 2 else None,
        expand_timesteps=experts == 1,
    )


def tiny_wan(
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    experts: int = 1,
    **kwargs,
) -> Wan:
    """A tiny random Wan 2.2 FlowModel: TI2V-5B-like (experts=1) or T2V-A14B-like (experts=2); by default a
    5-frame clip (2 latent frames)."""
    c = tiny_wan_components(seed, experts=experts)
    for t in (c["transformer"], c["transformer_2"]):
        if t is not None and dtype != torch.float32:
            t.to(dtype)
    kwargs.setdefault("num_frames", TINY_WAN_FRAMES)
    kwargs.setdefault("max_sequence_length", TINY_WAN_TEXT_LENGTH)
    return Wan.from_modules(
        c["transformer"],
        c["vae"],
        c["text_encoder"],
        c["tokenizer"],
        transformer_2=c["transformer_2"],
        boundary_ratio=c["boundary_ratio"],
        expand_timesteps=c["expand_timesteps"],
        flow_shift=TINY_WAN_FLOW_SHIFT,
        device=device,
        **kwargs,
    )


# ----------------------------------------------------------------------------------------------------
# BAGEL


def tiny_bagel_components(seed: int = 0) -> dict:
    """Random-init tiny BAGEL parts (fp32, CPU): a two-layer MoT decoder of BAGEL's structure (grouped-query
    attention, QK-norm, both experts per layer), Qwen2's tokenizer with the chat and vision markers, and a 4-channel
    VAE with FLUX's latent scale and shift."""
    tokenizer = tiny_qwen_tokenizer(EDIT_PROMPT_TEMPLATE, EDIT_PROMPT_DROP)  # the one with the vision markers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = BagelTransformer(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            latent_channels=4,
            max_latent_size=16,
        )
        # BAGEL's RMSNorm weights start at 1; random ones make each norm matter in the tests
        for n, p in transformer.named_parameters():
            if "norm" in n:
                p.data.uniform_(0.5, 1.5)
        vae = _tiny_vae(scaling_factor=0.3611, shift_factor=0.1159)
    for m in (transformer, vae):
        m.eval()
    return dict(transformer=transformer, vae=vae, tokenizer=tokenizer)


def tiny_bagel(
    seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kwargs
) -> Bagel:
    """A tiny random BAGEL FlowModel (64x64 images: 16 latent tokens)."""
    c = tiny_bagel_components(seed)
    if dtype != torch.float32:
        c["transformer"].to(dtype)
    return Bagel.from_modules(c["transformer"], c["vae"], c["tokenizer"], device=device, **kwargs)
