"""OCR by a VLM transcriber (e.g. Qwen2.5-VL-3B-Instruct, Qwen3-VL-8B-Instruct) through vLLM.

Two engines with one request (`transcribe_messages`), both `OcrEngine`s for `OcrReward`, which scores
their text the same way as PP-OCR's:
- `VlmOcrEngine`: the `openai` client of vLLM's OpenAI-compatible server (`vllm serve <model>`): one chat
  request per image, sent concurrently (bounded), image as a base64 PNG data URL, greedy decoding by
  default so the reward is not itself random; the client's timeouts and retries (5xx, 408/409/429,
  dropped connections, timeouts; exponential backoff or the server's Retry-After).
- `VllmOcrEngine`: an in-process `vllm.LLM` (vllm is imported only when this engine is built; it is in
  the optional `vllm` extra).

Spec for `build_reward`: {"name": "ocr", "engine": "vlm", "base_url": "http://127.0.0.1:8000", "model": ...}
(server) or {"name": "ocr", "engine": "vllm", "model": ...} (in-process).

vLLM cannot run on a CPU machine, so the tests check `VlmOcrEngine` against a fake OpenAI-compatible
server on 127.0.0.1 (aiohttp.web), and `VllmOcrEngine` against a stub `vllm` module; neither has been run
against a real model.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import openai
from openai.types.chat import ChatCompletionMessageParam

from fgrpo.rewards.transport import RewardServiceError, b64, encode_image

DEFAULT_PROMPT = "output only the text in the image"


def transcribe_messages(image: np.ndarray, prompt: str = DEFAULT_PROMPT) -> list[ChatCompletionMessageParam]:
    """OpenAI chat messages asking a VLM to transcribe one uint8 RGB image [H, W, 3]."""
    url = "data:image/png;base64," + b64(encode_image(image, "png"))
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}],
        }
    ]


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
        self.client = openai.OpenAI(
            base_url=self.base_url, api_key=api_key or "EMPTY", timeout=timeout_s, max_retries=max_retries
        )

    def transcribe(self, image: np.ndarray) -> str:
        """The text of one uint8 RGB image [H, W, 3]; RewardServiceError (one line, naming the server and
        the fix) when the server cannot be reached, keeps failing or answers something else."""
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
