"""OCR by a VLM transcriber (e.g. Qwen2.5-VL-3B-Instruct, Qwen3-VL-8B-Instruct) through vLLM.

Two engines with one request shape (`transcribe_messages`), both `OcrEngine`s for `OcrReward`:
- `VlmOcrEngine`: a client of vLLM's OpenAI-compatible server (`vllm serve <model>`): one chat request
  per image, sent concurrently (bounded), image as a base64 PNG data URL, greedy decoding by default so the
  reward is not itself random.
- `VllmOcrEngine`: an in-process `vllm.LLM` (vllm is imported only when this engine is built; it is in
  the optional `vllm` extra).

vLLM cannot run on the CPU dev box, so the tests check the request/response handling of `VlmOcrEngine`
against a local fake OpenAI-compatible server on 127.0.0.1 (aiohttp.web), and `VllmOcrEngine` against a
stub `vllm` module; neither has been run against a real model here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import numpy as np

from fgrpo.rewards.transport import b64, encode_image, post_json, run_sync

DEFAULT_PROMPT = "output only the text in the image"


def transcribe_messages(image: np.ndarray, prompt: str = DEFAULT_PROMPT) -> list[dict[str, Any]]:
    """OpenAI chat messages asking a VLM to transcribe one uint8 RGB image [H, W, 3]."""
    url = "data:image/png;base64," + b64(encode_image(image, "png"))
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}],
        }
    ]


def _completion_text(body: Any) -> str:
    """choices[0].message.content of an OpenAI chat completion; ValueError when the body has no such text."""
    try:
        text = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError("not an OpenAI chat completion: no choices[0].message.content") from e
    if text is None:
        return ""  # some servers send null content for an empty answer
    if not isinstance(text, str):
        raise ValueError(f"choices[0].message.content is {type(text).__name__}, not a string")
    return text


class VlmOcrEngine:
    """Client of an OpenAI-compatible chat server (vLLM's `vllm serve`) used as an OCR engine.

    Args:
        base_url: server root, e.g. "http://127.0.0.1:8000" (the client posts to {base_url}/v1/chat/completions).
        model: the served model name, e.g. "Qwen/Qwen2.5-VL-3B-Instruct".
        prompt: instruction sent after the image.
        temperature: 0 = greedy decoding, so the same image always gets the same reward.
        max_tokens: cap on the transcription length (generated text is short).
        max_concurrency: requests in flight at once; vLLM batches them on the server.
        timeout_s, max_retries, backoff_s: per request; see transport.post_json.
        api_key: sent as a Bearer token when the server wants one.
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
        backoff_s: float = 0.5,
        api_key: str | None = None,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.url = base_url.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"
        self.model, self.prompt = model, prompt
        self.temperature, self.max_tokens = float(temperature), int(max_tokens)
        self.max_concurrency = max_concurrency
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def request(self, image: np.ndarray) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": transcribe_messages(image, self.prompt),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }

    async def _recognize(self, images: np.ndarray) -> list[str]:
        sem = asyncio.Semaphore(self.max_concurrency)
        async with aiohttp.ClientSession(headers=self.headers) as session:

            async def one(image: np.ndarray) -> str:
                async with sem:
                    text, _ = await post_json(
                        session,
                        self.url,
                        self.request(image),
                        _completion_text,
                        timeout_s=self.timeout_s,
                        max_retries=self.max_retries,
                        backoff_s=self.backoff_s,
                    )
                    return text

            return list(await asyncio.gather(*(one(im) for im in images)))

    def recognize(self, images: np.ndarray) -> list[str]:
        return run_sync(lambda: self._recognize(images))


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
            import vllm
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
