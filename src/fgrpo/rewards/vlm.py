"""OCR by a VLM transcriber (e.g. Qwen2.5-VL-3B-Instruct, Qwen3-VL-8B-Instruct) through vLLM or transformers.

Three engines with one request (`chat_request`: the image, then the instruction, in one user turn), all
`OcrEngine`s for `OcrReward`, which scores their text the same way as PP-OCR's:
- `VlmOcrEngine`: the `openai` client of vLLM's OpenAI-compatible server (`vllm serve <model>`): one chat
  request per image, sent concurrently (bounded), image as a base64 PNG data URL, greedy decoding by
  default so the reward is not itself random; the client's timeouts and retries (5xx, 408/409/429,
  dropped connections, timeouts; exponential backoff or the server's Retry-After).
- `VllmOcrEngine`: an in-process `vllm.LLM` (vllm is imported only when this engine is built; it is in
  the optional `vllm` extra).
- `TransformersOcrEngine`: greedy `generate` of a transformers Qwen-VL model in this process, on the
  training GPU beside the policy; batches of images, bf16.

Spec for `build_reward`: {"name": "ocr", "engine": "vlm", "base_url": "http://127.0.0.1:8000", "model": ...}
(server), {"name": "ocr", "engine": "vllm", "model": ...} (in-process) or
{"name": "ocr", "engine": "transformers", "model": "/path/to/checkpoint", "max_tokens": 16} (in-process).

vLLM cannot run on a CPU machine, so the tests check `VlmOcrEngine` against a fake OpenAI-compatible
server on 127.0.0.1 (aiohttp.web), and `VllmOcrEngine` against a stub `vllm` module; neither has been run
against a real model. `TransformersOcrEngine` runs in the tests on a tiny random Qwen2.5-VL
(benchmarks/vlm_model.py, which also builds the random 3B-sized one that benchmarks time).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fgrpo.models.qwen_vl import vl_processor
from fgrpo.rewards.transport import RewardServiceError, b64, encode_image

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

DEFAULT_PROMPT = "output only the text in the image"


def chat_request(image_part: dict[str, Any], prompt: str = DEFAULT_PROMPT) -> list[Any]:
    """The chat every engine sends: one user turn holding the image part, then the instruction."""
    return [{"role": "user", "content": [image_part, {"type": "text", "text": prompt}]}]


def transcribe_messages(image: np.ndarray, prompt: str = DEFAULT_PROMPT) -> list[ChatCompletionMessageParam]:
    """OpenAI chat messages asking a VLM to transcribe one uint8 RGB image [H, W, 3]."""
    url = "data:image/png;base64," + b64(encode_image(image, "png"))
    return chat_request({"type": "image_url", "image_url": {"url": url}}, prompt)


def _completion_text(completion: Any) -> str:
    """choices[0].message.content of a chat completion; ValueError when it has no such text."""
    try:
        text = completion.choices[0].message.content
    except (AttributeError, IndexError, TypeError) as e:
        raise ValueError("not an OpenAI chat completion: no choices[0].message.content") from e
    if text is None:
        return ""  # some servers send null content for an empty answer
    if not isinstance(text, str):
        raise ValueError(f"choices[0].message.content is {type(text).__name__}, not a string")
    return text


class VlmOcrEngine:
    """Client of an OpenAI-compatible chat server (vLLM's `vllm serve`) used as an OCR engine.

    Args:
        base_url: server root, with or without /v1, e.g. "http://127.0.0.1:8000".
        model: the served model name, e.g. "Qwen/Qwen2.5-VL-3B-Instruct".
        prompt: instruction sent after the image.
        temperature: 0 = greedy decoding, so the same image always gets the same reward.
        max_tokens: cap on the transcription length (generated text is short).
        max_concurrency: requests in flight at once; vLLM batches them on the server.
        timeout_s: per attempt of one request.
        max_retries: retries of one request after the first attempt (the openai client's).
        api_key: what the server was started with (`vllm serve --api-key`); None sends a placeholder,
            since the client refuses to run without a key and vLLM ignores it unless it set one.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        prompt: str = DEFAULT_PROMPT,
        temperature: float = 0.0,
        max_tokens: int = 64,
        max_concurrency: int = 16,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        api_key: str | None = None,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.base_url = base_url.rstrip("/").removesuffix("/v1") + "/v1"
        self.url = self.base_url + "/chat/completions"
        self.model, self.prompt = model, prompt
        self.temperature, self.max_tokens = float(temperature), int(max_tokens)
        self.max_concurrency, self.timeout_s, self.max_retries = max_concurrency, timeout_s, max_retries
        # Imported here: the in-process engines need neither openai nor its seconds of import.
        import openai

        self.client = openai.OpenAI(
            base_url=self.base_url, api_key=api_key or "EMPTY", timeout=timeout_s, max_retries=max_retries
        )

    def transcribe(self, image: np.ndarray) -> str:
        """The text of one uint8 RGB image [H, W, 3]; RewardServiceError (one line, naming the server and
        the fix) when the server cannot be reached, keeps failing or answers something else."""
        import openai

        attempts = f"{self.max_retries + 1} attempt(s)"
        try:
            completion = self.client.chat.completions.create(
                model=self.model,
                messages=transcribe_messages(image, self.prompt),
                temperature=self.temperature,
                max_tokens=self.max_tokens,
            )
            return _completion_text(completion)
        except openai.APITimeoutError as e:
            raise RewardServiceError(
                f"VLM server {self.url} timed out ({attempts} of timeout_s={self.timeout_s}); raise timeout_s "
                "or check that the server is not overloaded"
            ) from e
        except openai.APIConnectionError as e:
            raise RewardServiceError(
                f"VLM server {self.url} unreachable after {attempts} ({e}); start it (vllm serve "
                f"{self.model}) or fix base_url"
            ) from e
        except openai.APIStatusError as e:
            raise RewardServiceError(
                f"VLM server {self.url} answered HTTP {e.status_code} ({e.message}); 5xx/408/409/429 are retried "
                f"({attempts}), other codes mean a bad request (model name {self.model!r}? api_key?)"
            ) from e
        except ValueError as e:  # a body that is not JSON (JSONDecodeError) or not a chat completion
            raise RewardServiceError(f"VLM server {self.url}: malformed response: {e}") from e

    def recognize(self, images: np.ndarray) -> list[str]:
        if len(images) == 0:
            return []
        with ThreadPoolExecutor(min(self.max_concurrency, len(images)), thread_name_prefix="vlm") as pool:
            return list(pool.map(self.transcribe, images))


class VllmOcrEngine:
    """In-process `vllm.LLM` transcriber; needs `uv sync --extra vllm` and a GPU.

    Args:
        model: HF id or local path of the VLM.
        llm_kwargs: passed to vllm.LLM (e.g. gpu_memory_utilization=0.2, max_model_len=4096).
    """

    def __init__(
        self,
        model: str,
        *,
        prompt: str = DEFAULT_PROMPT,
        temperature: float = 0.0,
        max_tokens: int = 64,
        **llm_kwargs: Any,
    ):
        try:
            import vllm  # pyright: ignore[reportMissingImports] - the optional `vllm` extra
        except ImportError as e:
            raise ImportError(
                "VllmOcrEngine needs vllm, which is in the optional extra: uv sync --extra vllm "
                "(or use VlmOcrEngine against a running `vllm serve`)"
            ) from e
        self.prompt = prompt
        self.llm = vllm.LLM(model=model, **llm_kwargs)
        self.sampling = vllm.SamplingParams(temperature=temperature, max_tokens=max_tokens)

    def recognize(self, images: np.ndarray) -> list[str]:
        conversations = [transcribe_messages(im, self.prompt) for im in images]
        outputs = self.llm.chat(conversations, self.sampling, use_tqdm=False)
        if len(outputs) != len(images):
            raise RuntimeError(f"vllm returned {len(outputs)} outputs for {len(images)} images")
        return [o.outputs[0].text for o in outputs]


IMAGE_BACKENDS = ("pil", "torchvision")
# A name with "flash" in it: transformers' Qwen-VL vision attention then hands the function its windows' offsets
# (cu_seqlens) for one call, instead of calling it once per window.
VARLEN_VISION = "flash_varlen_torch"


def varlen_vision_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    *,
    scaling: float | None = None,
    cu_seq_lens_q: Any = None,
    cu_seq_lens_k: Any = None,
    max_length_q: Any = None,
    max_length_k: Any = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """Attention within each packed window (transformers' attention interface): query, key, value [1, H, T, D]
    with the windows' offsets cu_seq_lens [N + 1] -> [1, T, H, D]. On a GPU one call of torch's varlen_attn
    (FlashAttention's variable-length kernel); elsewhere one scaled_dot_product_attention per window, what
    transformers runs for "sdpa". Qwen2.5-VL's vision tower otherwise runs one SDPA call per window in each
    layer: tens of thousands of kernels launched from the scoring thread for a few images (RESULTS fp8-6)."""
    import torch
    import torch.nn.functional as F

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    if q.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
        out: Any = varlen_attn(q, k, v, cu_q, cu_k, int(max_length_q), int(max_length_k), scale=scaling)
        return out.unsqueeze(0), None  # [T, H, D]: no auxiliary output asked for
    bounds = cu_seq_lens_q.tolist()
    parts = [
        F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=scaling).transpose(
            0, 1
        )
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(parts).unsqueeze(0), None


def use_varlen_vision(model: Any) -> None:
    """`varlen_vision_attention` in `model`'s vision tower (registered once with transformers); its language
    model keeps its own attention."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_VISION, varlen_vision_attention)
    # set_attn_implementation would look for a flash-attention package by the name; the attention reads this
    model.model.visual.config._attn_implementation_internal = VARLEN_VISION


def torchvision_image_processor(image_processor: Any) -> Any:
    """Qwen2-VL's image processor on transformers' torchvision backend with `image_processor`'s settings (pixel
    bounds, patch and merge sizes, mean and std)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor.from_dict(image_processor.to_dict())


def load_qwen_vl(path: str | Path, *, device: str = "cuda", dtype: str = "bfloat16") -> tuple[Any, Any]:
    """(model, processor) of a local Qwen2-VL or Qwen2.5-VL checkpoint directory, offline.

    The processor is Qwen2-VL's for images only (`fgrpo.models.qwen_vl.vl_processor`: PIL image
    backend, no video processor, so no torchvision) with the checkpoint's chat template; the model is
    AutoModelForImageTextToText in `dtype` on `device`.
    """
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {str(path)!r} has no config.json; give the local directory of a Qwen-VL checkpoint "
            "(config.json, weights, tokenizer, preprocessor_config.json); nothing is downloaded"
        )
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"dtype must name a torch dtype (bfloat16, float16, float32), got {dtype!r}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    legacy = path / "chat_template.json"  # the processor's template file of older checkpoints
    if tokenizer.chat_template is None and legacy.is_file():
        tokenizer.chat_template = json.loads(legacy.read_text())["chat_template"]
    if tokenizer.chat_template is None:
        raise ValueError(
            f"model {str(path)!r} has no chat template (chat_template.jinja, chat_template.json or "
            "tokenizer_config.json's chat_template); copy the checkpoint's template file there"
        )
    processor = vl_processor(Qwen2VLImageProcessorPil.from_pretrained(path), tokenizer)
    model: Any = AutoModelForImageTextToText.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device), processor


class TransformersOcrEngine:
    """Greedy `generate` of a transformers Qwen-VL model in this process (e.g. on the training GPU).

    Each batch is one chat per image (`chat_request` through the processor's chat template and image
    expansion), decoded greedily so the reward is not itself random; only the generated tokens are decoded.
    The images of one call share a size, so every row has the same number of tokens: no padding, and a
    batch reads each image as it would alone.

    Args:
        model: local checkpoint directory (loaded by `load_qwen_vl`), or a built model (then `processor`).
        processor: with a built model: its processor (the tokenizer holding the chat template).
        device, dtype: where and in what a directory's model is loaded.
        batch_size: images per `generate` call (bounds the activations and the KV cache).
        max_tokens: cap on the transcription length (generate's max_new_tokens).
        prompt: instruction sent after the image.
        static_cache: a preallocated KV cache (generate's cache_implementation="static") instead of one that
            grows a token at a time. The tokens are the same (greedy); on a GPU transformers then compiles the
            decoding step with torch.compile, which replays it as CUDA graphs: the first call of each batch
            size compiles (tens of seconds), later ones skip most of the per-token launch work. Make that first
            call before any other thread runs a module: compiling traces with torch.fx, which patches
            nn.Module.__call__ process-wide, so a compile on a reward thread breaks a rollout running beside it.
        image_backend: "pil" resizes, rescales and cuts the images into patches on the CPU with PIL and numpy,
            on the thread that scores (beside a rollout's launching thread); "torchvision" does it on the model's
            device, a batch at a time, with the processor's settings (transformers' torchvision backend, what
            AutoProcessor picks where torchvision is installed). Both give the same tokens; the pixels agree to
            float rounding where no resize is needed, and differ where one is (torchvision's bicubic on tensors
            against PIL's; 512² images on a GPU in RESULTS fp8-6). Its chat tokens are tokenized once per batch
            size and image size.
        varlen_vision: the vision tower's windowed attention as one variable-length call per layer
            (`varlen_vision_attention`) instead of one SDPA call per window; set on `model` itself.
    """

    def __init__(
        self,
        model: Any,
        processor: Any = None,
        *,
        device: str = "cuda",
        dtype: str = "bfloat16",
        batch_size: int = 32,
        max_tokens: int = 64,
        prompt: str = DEFAULT_PROMPT,
        static_cache: bool = False,
        image_backend: str = "pil",
        varlen_vision: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if image_backend not in IMAGE_BACKENDS:
            raise ValueError(f"image_backend must be one of {list(IMAGE_BACKENDS)}, got {image_backend!r}")
        if isinstance(model, str | Path):
            if processor is not None:
                raise ValueError("give a processor only with a built model; a directory has its own")
            model, processor = load_qwen_vl(model, device=device, dtype=dtype)
        elif processor is None:
            raise ValueError("a built model needs its processor: TransformersOcrEngine(model, processor)")
        if image_backend == "torchvision":
            processor = vl_processor(
                torchvision_image_processor(processor.image_processor), processor.tokenizer
            )
        if varlen_vision:
            use_varlen_vision(model)
        self.model, self.processor = model.eval(), processor
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self.on_device = image_backend == "torchvision"
        self._tokens: dict[tuple[int, ...], dict[str, Any]] = {}  # the torchvision path's chat tokens
        self.cache = {"cache_implementation": "static"} if static_cache else {}
        self.text = processor.tokenizer.apply_chat_template(
            chat_request({"type": "image"}, prompt), add_generation_prompt=True, tokenize=False
        )

    def _device_inputs(self, batch: Any, text: list[str]) -> dict[str, Any]:
        """generate's inputs for uint8 `batch` [B, H, W, 3] with the torchvision backend: the pixels computed on
        the model's device; the chat's tokens, which depend only on the batch size and the images' patch grid
        (one size for all images of a call), tokenized once per (size, grid) and kept on the device."""
        device = self.model.device
        x = batch.to(device).permute(0, 3, 1, 2)  # [B, 3, H, W]
        pixels = self.processor.image_processor(images=x, return_tensors="pt", device=device)
        key = (len(text), *pixels["image_grid_thw"][0].tolist())
        if key not in self._tokens:
            full = self.processor(text=text, images=x, return_tensors="pt", device=device)
            self._tokens[key] = {k: v.to(device) for k, v in full.items() if k not in pixels}
        return {**self._tokens[key], **{k: v.to(device) for k, v in pixels.items()}}

    def recognize(self, images: np.ndarray) -> list[str]:
        import torch

        texts: list[str] = []
        for start in range(0, len(images), self.batch_size):
            batch = images[start : start + self.batch_size]
            text = [self.text] * len(batch)
            if self.on_device:
                inputs = self._device_inputs(torch.from_numpy(np.ascontiguousarray(batch)), text)
            else:
                inputs = self.processor(text=text, images=list(batch), return_tensors="pt")
                inputs = inputs.to(self.model.device)
            with torch.inference_mode():
                ids = self.model.generate(
                    **inputs, do_sample=False, max_new_tokens=self.max_tokens, **self.cache
                )
            new = ids[:, inputs["input_ids"].shape[1] :]  # generate returns the prompt, then the new tokens
            texts += self.processor.tokenizer.batch_decode(new, skip_special_tokens=True)
        return texts
