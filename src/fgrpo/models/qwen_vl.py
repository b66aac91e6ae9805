"""Qwen2-VL's processor for images only: what Qwen-Image-Edit's VL text encoder and the VLM OCR reward feed their
Qwen2-VL / Qwen2.5-VL. Imports nothing heavy until called (the reward service loads it without torch)."""

from __future__ import annotations


def vl_processor(image_processor, tokenizer):
    """Qwen2-VL's processor (what QwenImageEditPipeline takes) for images only, without torchvision (fgrpo does not
    depend on it): `image_processor` is transformers' PIL backend (its bicubic resize may round a VL pixel
    differently from the torchvision one) and there is no video processor, which transformers' constructor
    otherwise insists on (videos are never passed)."""
    from transformers import Qwen2VLProcessor

    class ImagesOnlyProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnlyProcessor(image_processor=image_processor, tokenizer=tokenizer)
