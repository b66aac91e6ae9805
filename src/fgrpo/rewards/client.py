"""A Reward that scores through the HTTP reward service (`python -m fgrpo.rewards.serve`).

The batch is split into requests of `batch_size` images, sent with at most `max_concurrency` in flight.
Each request has a timeout and bounded retries with exponential backoff (transport.post_json); when a
request still fails the whole call raises RewardServiceError — a score is never made up. Every call
opens fresh connections, so a restarted service is picked up by the next call. When the environment variable
FGRPO_REWARD_TOKEN is set, every request carries `Authorization: Bearer <its value>`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from typing import Any, Literal

import aiohttp
import numpy as np

from fgrpo.errors import ConfigError
from fgrpo.rewards.base import RewardOutput, check_inputs, concat_outputs
from fgrpo.rewards.transport import (
    TOKEN_ENV,
    NonRetryableError,
    RewardServiceError,
    output_from_json,
    post_json,
    request_to_json,
    run_sync,
    unauthorized,
)


class HttpReward:
    """Client of the reward service.

    Args:
        url: service root, e.g. "http://127.0.0.1:8765".
        timeout_s: per request (a batch of batch_size images), including the remote scoring time.
        max_retries: retries per request after the first attempt (0 = no retry).
        backoff_s: sleep before retry k is backoff_s * 2^(k-1), capped at 10 s.
        batch_size: images per request.
        max_concurrency: requests in flight at once (the service scores one request at a time; 2 keeps the
            next request uploaded while the current one is scored).
        image_format: "png" (lossless, default) or "jpeg" (quality 95; smaller, but changes the pixels).

    The token of a service that needs one is read from FGRPO_REWARD_TOKEN when the client is made: from the
    environment, so that it never lands in a reward spec or a run's config.json.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int = 16,
        max_concurrency: int = 2,
        image_format: Literal["png", "jpeg"] = "png",
    ):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"reward service url must start with http:// or https://, got {url!r}")
        if batch_size < 1 or max_concurrency < 1:
            raise ConfigError(
                f"batch_size and max_concurrency must be >= 1, got {batch_size}, {max_concurrency}"
            )
        if image_format not in ("png", "jpeg"):
            raise ConfigError(f"image_format must be 'png' or 'jpeg', got {image_format!r}")
        self.url = url.rstrip("/")
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.batch_size, self.max_concurrency, self.image_format = batch_size, max_concurrency, image_format
        token = os.environ.get(TOKEN_ENV, "").strip()
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    def health(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """GET /health once; raises RewardServiceError (with how to start the service) when it is not up,
        or when the service takes fewer images per request than this client's batch_size; Unauthorized
        (naming FGRPO_REWARD_TOKEN) when it needs a token this client lacks."""

        async def get() -> dict[str, Any]:
            async with aiohttp.ClientSession(headers=self._headers) as s:
                async with s.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                    if r.status == 401:
                        raise unauthorized(self.url + "/health", token_sent=bool(self._headers))
                    if r.status != 200:
                        raise RewardServiceError(f"{self.url}/health answered HTTP {r.status}")
                    return json.loads(await r.text())

        try:
            status = run_sync(get)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise RewardServiceError(
                f"reward service at {self.url} is not up ({type(e).__name__}: {e}); start it with "
                f"python -m fgrpo.rewards.serve --reward <spec> --port <port>"
            ) from e
        max_images = status.get("max_images") if isinstance(status, dict) else None
        if isinstance(max_images, int) and self.batch_size > max_images:
            raise RewardServiceError(
                f"reward service at {self.url} takes at most {max_images} images per request, this client "
                f"sends batch_size={self.batch_size}; lower batch_size or restart the service with "
                f"--max-images {self.batch_size}"
            )
        return status

    async def _score(
        self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]
    ) -> RewardOutput:
        sem = asyncio.Semaphore(self.max_concurrency)
        starts = range(0, len(images), self.batch_size)
        async with aiohttp.ClientSession(headers=self._headers) as session:

            async def one(i: int) -> tuple[RewardOutput, int]:
                j = i + self.batch_size
                payload = request_to_json(images[i:j], prompts[i:j], metadata[i:j], self.image_format)
                async with sem:
                    return await post_json(
                        session,
                        self.url + "/score",
                        payload,
                        lambda body: output_from_json(body, len(images[i:j])),
                        timeout_s=self.timeout_s,
                        max_retries=self.max_retries,
                        backoff_s=self.backoff_s,
                    )

            results = await asyncio.gather(*(one(i) for i in starts))
        out = concat_outputs([r for r, _ in results])
        out.metrics["http/retry_count"] = float(sum(n for _, n in results))
        return out

    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardOutput:
        meta = check_inputs(images, prompts, metadata)
        if len(images) == 0:
            return RewardOutput(scores=np.zeros(0, np.float32))
        t0 = time.perf_counter()
        try:
            out = run_sync(lambda: self._score(images, list(prompts), meta))
        except NonRetryableError:
            raise  # the service is up and refused this request: its message says why
        except RewardServiceError as e:
            raise RewardServiceError(
                f"reward service {self.url} could not score the batch: {e}. Is it running? "
                f"Start it with python -m fgrpo.rewards.serve --reward <spec> --port <port>"
            ) from e
        out.metrics["http/time_per_image_s"] = (time.perf_counter() - t0) / len(images)
        return out
