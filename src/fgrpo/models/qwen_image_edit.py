"""Qwen-Image-Edit behind the FlowModel interface: Qwen-Image whose every velocity call also sees a condition image.

Mirrors diffusers' QwenImageEditPipeline (0.40):
- Condition image: resized (Lanczos) to the aspect ratio of the image at `condition_area` pixels, sides rounded
  to multiples of 32 (the pipeline's `calculate_dimensions`, 1024² there), scaled to [-1, 1], VAE-encoded (the
  posterior's mode), normalised with the VAE's per-channel latent mean/std: `image_latents` [C, ch, cw].
- Transformer input: the condition latents are packed like x_t and appended after x_t's tokens along the
  sequence; `img_shapes` per sample is [(1, h/2, w/2), (1, ch/2, cw/2)] (RoPE places the two images apart);
  the velocity is the first (h/2)(w/2) output tokens.
- Text: Qwen2.5-VL reads the instruction after the same resized image in the edit chat template (the processor
  expands `<|image_pad|>` into the image's tokens); the last layer's hidden states minus the 64 system-prefix
  tokens are the conditioning, the image's tokens included.
- True CFG: the negative prompt is encoded with the same image (so every row has its own negative embedding);
  both branches see the condition tokens; the combination is Qwen-Image's (per-token norm rescale).

The condition image of a prompt is the file its `fgrpo.models.base.ImagePrompt` names (a .jsonl row
{"prompt": ..., "image": path}); a plain-string prompt is an error.

Differs from QwenImageEditPipeline: as QwenImage (unpacked x_t, one batched CFG forward, timestep = sigma),
and: the condition area is a constructor argument; encodings are cached per (prompt, image file) and
condition latents per image file; the condition images of one batch must give one latent shape (one aspect
ratio), where the pipeline would silently use the first sample's RoPE shapes for all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import torch

from fgrpo.models.base import Cond, ImagePrompt
from fgrpo.models.common import PromptCache, module_device, pad_stack
from fgrpo.models.qwen_image import QwenImage, pack
from fgrpo.models.qwen_vl import vl_processor

if TYPE_CHECKING:
    from PIL import Image

# QwenImageEditPipeline's prompt_template_encode and prompt_template_encode_start_idx: the system/user prefix
# (64 tokens with Qwen's tokenizer) is dropped; the image placeholder and the instruction are kept.
EDIT_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
EDIT_PROMPT_DROP = 64
# The pipeline's condition image size: its aspect ratio at about one megapixel.
CONDITION_AREA = 1024 * 1024
# A (prompt, image) encoding holds the image's VL tokens too (~1300 at 1024², 10 MB in bf16 for the 7B encoder),
# so the cache is sized for one step's distinct prompts and negatives, not for the whole prompt set.
EDIT_CACHE_SIZE = 64


def condition_image(prompt: str) -> str:
    """The condition image file that `prompt` names (fgrpo.models.base.ImagePrompt), or a one-line error."""
    if not isinstance(prompt, ImagePrompt):
        raise ValueError(
            f"Qwen-Image-Edit needs a condition image per prompt, but {prompt[:80]!r} names none; give the prompts "
            'as a .jsonl file with rows {"prompt": "...", "image": "path/to/image.png"}'
        )
    return prompt.image


class QwenImageEdit(QwenImage):
    """Qwen-Image-Edit (VL text encoder + processor, transformer, VAE) as a FlowModel; weights frozen."""

    def __init__(
        self,
        transformer,
        vae,
        text_encoder: torch.nn.Module | None,
        tokenizer,
        *,
        processor,
        condition_area: int = CONDITION_AREA,
        prompt_cache_size: int = EDIT_CACHE_SIZE,
        **kwargs,
    ):
        from diffusers.image_processor import VaeImageProcessor

        super().__init__(
            transformer, vae, text_encoder, tokenizer, prompt_cache_size=prompt_cache_size, **kwargs
        )
        self.processor = processor
        self.condition_area = condition_area
        # Regional compile with inductor's comprehensive padding: the first compiled backward of the 4-row training
        # forward asserted a padded stride ((4, 1385, 1) against (1408, 1, 1): the text with the condition's VL
        # tokens, 1385, padded to 1408) on the H200; without the padding it trains, gap 0.
        transformer._fgrpo_compile_options = {"comprehensive_padding": False}
        # The pipeline's image processor: Lanczos resize, [0, 255] -> [-1, 1].
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale * self.patch)
        self.condition_cache: PromptCache[str] = PromptCache(self._encode_condition, prompt_cache_size)
        self.instruction_cache: PromptCache[tuple[str, str]] = PromptCache(
            self._encode_instruction, prompt_cache_size
        )

    @classmethod
    def from_pretrained(cls, path, **kwargs) -> Self:
        """Load a diffusers-format Qwen-Image-Edit directory or hub id (QwenImage's subfolders + processor)."""
        from transformers import Qwen2Tokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path), subfolder="processor")
        tokenizer = Qwen2Tokenizer.from_pretrained(str(path), subfolder="tokenizer")
        return super().from_pretrained(path, processor=vl_processor(image_processor, tokenizer), **kwargs)

    # ------------------------------------------------------------------------------------------------
    def _condition_pil(self, path: str) -> Image.Image:
        """The condition image at the pipeline's condition size (what both the VAE and the VL encoder see)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
        from PIL import Image

        with Image.open(path) as f:
            image = f.convert("RGB")
        width, height, _ = calculate_dimensions(self.condition_area, image.width / image.height)
        resized: Any = self.image_processor.resize(image, int(height), int(width))
        return resized

    @torch.no_grad()
    def _encode_condition(self, path: str) -> tuple[torch.Tensor]:
        """Condition image file -> normalised VAE latents [C, ch, cw] in the transformer's dtype."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import retrieve_latents

        image = self._condition_pil(path)
        cfg: Any = self.vae.config
        vdtype = next(self.vae.parameters()).dtype
        pixels = self.image_processor.preprocess(image, image.height, image.width)  # [1, 3, H, W] in [-1, 1]
        pixels = pixels[:, :, None].to(device=module_device(self.vae), dtype=vdtype)  # one video frame
        # [1, C, 1, ch, cw], the posterior's mode (diffusers annotates retrieve_latents' input as a Tensor; it
        # takes the VAE's output, as in the pipeline)
        z = retrieve_latents(self.vae.encode(pixels), sample_mode="argmax")  # pyright: ignore[reportArgumentType]
        mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
        z = (z - mean) / std  # the pipeline's expression
        return (z[0, :, 0].to(device=self.device, dtype=self.dtype),)

    @torch.no_grad()
    def _encode_instruction(self, key: tuple[str, str]) -> tuple[torch.Tensor]:
        """(prompt, image file) -> conditioning tokens [L, D] (image tokens + instruction, prefix dropped)."""
        prompt, path = key
        if self.text_encoder is None:
            raise RuntimeError(
                "this QwenImageEdit was built without a text encoder; pass one to encode prompts"
            )
        inputs = self.processor(
            text=[EDIT_PROMPT_TEMPLATE.format(prompt)],
            images=[self._condition_pil(path)],
            padding=True,
            return_tensors="pt",
        ).to(module_device(self.text_encoder))
        out = self.text_encoder(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            output_hidden_states=True,
        )
        hidden = out.hidden_states[-1][0, EDIT_PROMPT_DROP:]  # [L, D]
        return (hidden.to(device=self.device, dtype=self.dtype),)

    def encode(self, prompts: Sequence[str], *, negative_prompt: str | None = None) -> Cond:
        """Rows [B]: the instruction read with its image, the image's latents, and (CFG) the negative prompt
        read with the same image."""
        if len(prompts) == 0:
            raise ValueError("prompts is empty; pass at least one prompt")
        images = [condition_image(p) for p in prompts]
        latents = [self.condition_cache(path)[0] for path in images]
        shapes = sorted({tuple(z.shape) for z in latents})
        if len(shapes) > 1:
            raise ValueError(
                f"the condition images of one batch give latents of shapes {shapes}; every image of a batch needs "
                "the same aspect ratio (crop or pad the images to one)"
            )
        embeds, mask = pad_stack(
            [self.instruction_cache((str(p), path))[0] for p, path in zip(prompts, images)]
        )
        cond = {"prompt_embeds": embeds, "prompt_mask": mask, "image_latents": torch.stack(latents)}
        if negative_prompt is not None:
            neg, neg_mask = pad_stack([self.instruction_cache((negative_prompt, path))[0] for path in images])
            cond["neg_prompt_embeds"], cond["neg_prompt_mask"] = neg, neg_mask
        return cond

    def _image_sequence(self, x: torch.Tensor, cond: Cond, h: int, w: int) -> tuple[torch.Tensor, Any]:
        """x_t's tokens, then the condition image's ([B, N + M, 4C]); RoPE shapes of both images."""
        z = cond["image_latents"]  # [B, C, ch, cw]
        ch, cw = z.shape[-2:]
        p = self.patch
        return torch.cat([x, pack(z).to(x.dtype)], dim=1), [(1, h // p, w // p), (1, ch // p, cw // p)]
