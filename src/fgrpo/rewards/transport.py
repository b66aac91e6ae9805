"""What the HTTP reward service and the VLM client share: image codecs, the JSON wire format, and one
bounded retry loop for POSTs.

Wire format of the reward service (JSON, images as base64 PNG or JPEG bytes):
  POST /score   {"images": [b64, ...], "prompts": [str, ...], "metadata": [dict, ...] | null}
           ->   {"scores": [float, ...], "components": {name: [float | null, ...]}, "metrics": {name: float}}
  GET  /health  -> {"status": "ok", "reward": str, "requests": int, "images": int,
                     "max_images": int, "max_pixels": int, "max_request_bytes": int, "max_json_values": int}
NaN (an excluded MultiReward member) travels as null, since JSON has no NaN. A service started with a token
answers 401 to any request without the header `Authorization: Bearer <token>`; clients read the token from
the environment variable FGRPO_REWARD_TOKEN.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import json
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import numpy as np
from PIL import Image

from fgrpo.errors import FgrpoError
from fgrpo.rewards.base import RewardOutput

T = TypeVar("T")

TOKEN_ENV = "FGRPO_REWARD_TOKEN"


class RewardServiceError(FgrpoError, RuntimeError):
    """A remote reward (HTTP service or VLM server) could not be reached or answered badly."""


class NonRetryableError(RewardServiceError):
    """The server understood the request and rejected it (4xx): retrying cannot help."""


class Unauthorized(NonRetryableError, FgrpoError):
    """The service answered 401: it needs a token this client did not send or sent wrong."""


def unauthorized(url: str, token_sent: bool) -> Unauthorized:
    """The error for a 401 from `url`, naming the environment variable that carries the token."""
    why = f"refused the token in {TOKEN_ENV}" if token_sent else f"needs a token and {TOKEN_ENV} is not set"
    return Unauthorized(
        f"{url} answered HTTP 401: the reward service {why}; set {TOKEN_ENV} to the token the service was "
        f"started with (its --token-file or its {TOKEN_ENV})"
    )


class TooManyImages(ValueError):
    """A request holds more images than the service takes at once (the service answers HTTP 413)."""


class ImageTooLarge(ValueError):
    """An image's header declares more pixels than the service decodes (the service answers HTTP 422)."""


class TooManyValues(ValueError):
    """A request body holds more JSON values than the service parses (the service answers HTTP 413)."""


# ---------------------------------------------------------------------------------------------- images


def encode_image(image: np.ndarray, fmt: str = "png") -> bytes:
    """uint8 RGB [H, W, 3] -> PNG (lossless; compress_level 1 trades size for speed) or JPEG (quality 95)."""
    buf = io.BytesIO()
    if fmt == "png":
        Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    elif fmt == "jpeg":
        Image.fromarray(image).save(buf, format="JPEG", quality=95)
    else:
        raise ValueError(f"image format must be 'png' or 'jpeg', got {fmt!r}")
    return buf.getvalue()


def decode_image(data: bytes, max_pixels: int | None = None) -> np.ndarray:
    """PNG/JPEG bytes -> uint8 RGB [H, W, 3].

    max_pixels: refuse (ImageTooLarge) an image whose header declares more pixels, before any pixel is
    decoded: a uniform PNG of 9000x9000 is a few kB on the wire and 243 MB decoded.
    """
    try:
        im = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as e:  # PIL's own cap, 2 * Image.MAX_IMAGE_PIXELS
        raise ImageTooLarge(f"over PIL's decompression-bomb limit ({e})") from None
    with im:
        w, h = im.size
        if max_pixels is not None and w * h > max_pixels:
            raise ImageTooLarge(f"{w}x{h} = {w * h:,} pixels, over the limit of {max_pixels:,}")
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# ---------------------------------------------------------------------------------------------- JSON


def request_to_json(
    images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]] | None, fmt: str = "png"
) -> dict[str, Any]:
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as e:
        raise TypeError(f"reward metadata must be JSON-serializable to go over HTTP: {e}") from e
    return {
        "images": [b64(encode_image(im, fmt)) for im in images],
        "prompts": list(prompts),
        "metadata": metadata,
    }


# A JSON string (skipped whole, so commas and brackets inside prompts do not count) or a character that
# starts a value of an array or object: every value but the first in its container follows a comma, and each
# container's first value follows its opening bracket.
_VALUE_MARK = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[,\[{]')


def count_json_values(data: bytes, limit: int) -> int:
    """An upper bound on the number of values (array items and object members) in the JSON text `data`,
    counted without parsing; stops counting once it passes `limit`, so its cost is bounded by `limit`.

    json.loads holds the GIL for its whole run: 20 M empty strings in one array take seconds, during which
    no other thread of the process (an event loop answering /health) runs. Counting first bounds that time.
    """
    # Counting every comma and bracket, in strings too, is a faster upper bound; most bodies stop there.
    rough = data.count(b",") + data.count(b"[") + data.count(b"{")
    if rough <= limit:
        return rough
    n = 0
    for m in _VALUE_MARK.finditer(data):
        if m.end() - m.start() == 1:  # a string match is at least its two quotes long
            n += 1
            if n > limit:
                break
    return n


def request_from_bytes(
    data: bytes, *, max_values: int, max_images: int | None = None, max_pixels: int | None = None
) -> tuple[np.ndarray, list[str], list[dict[str, Any]] | None]:
    """Parse and validate a /score request body from its bytes -> (images, prompts, metadata).

    Raises TooManyValues (more than max_values JSON values, counted before parsing), then as
    request_from_json; ValueError for a body that is not JSON.
    """
    n = count_json_values(data, max_values)
    if n > max_values:
        raise TooManyValues(f"the request holds over {max_values:,} JSON values, counted before parsing")
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"the body is not JSON: {type(e).__name__}: {e}") from None
    return request_from_json(body, max_images=max_images, max_pixels=max_pixels)


def request_from_json(
    body: Any, *, max_images: int | None = None, max_pixels: int | None = None
) -> tuple[np.ndarray, list[str], list[dict[str, Any]] | None]:
    """Parse and validate a /score request body -> (images [B, H, W, 3] uint8, prompts, metadata).

    Raises TooManyImages (more than max_images, before decoding any), ImageTooLarge (an image over
    max_pixels, from its header), ValueError (anything else malformed).
    """
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object with 'images' and 'prompts'")
    images, prompts, metadata = body.get("images"), body.get("prompts"), body.get("metadata")
    if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
        raise ValueError("'images' must be a list of base64-encoded PNG/JPEG strings")
    if not isinstance(prompts, list) or not all(isinstance(x, str) for x in prompts):
        raise ValueError("'prompts' must be a list of strings")
    if metadata is not None and not (
        isinstance(metadata, list) and all(isinstance(x, dict) for x in metadata)
    ):
        raise ValueError("'metadata' must be null or a list of objects")
    if max_images is not None and len(images) > max_images:
        raise TooManyImages(f"the request holds {len(images)} images, over the limit of {max_images}")
    arrays = []
    for i, x in enumerate(images):
        try:
            arrays.append(decode_image(base64.b64decode(x, validate=True), max_pixels))
        except ImageTooLarge as e:
            raise ImageTooLarge(f"image {i} is {e}") from None
        except Exception as e:
            raise ValueError(f"'images' holds something that is not base64 PNG/JPEG: {e}") from e
    if not arrays:
        return np.zeros((0, 1, 1, 3), np.uint8), prompts, metadata
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"all images of a request must share one size, got {sorted(shapes)}")
    return np.stack(arrays), prompts, metadata


def _nan_to_none(x: np.ndarray) -> list[float | None]:
    return [None if not math.isfinite(v) else float(v) for v in np.asarray(x, dtype=np.float64)]


def output_to_json(out: RewardOutput) -> dict[str, Any]:
    return {
        "scores": _nan_to_none(out.scores),
        "components": {k: _nan_to_none(v) for k, v in out.components.items()},
        "metrics": {k: (float(v) if math.isfinite(v) else None) for k, v in out.metrics.items()},
    }


def output_from_json(body: Any, n: int) -> RewardOutput:
    """Parse and validate a /score response for n images; raises ValueError on anything malformed."""
    if not isinstance(body, dict) or not isinstance(body.get("scores"), list):
        raise ValueError("response is not a JSON object with a 'scores' list")
    scores = body["scores"]
    if len(scores) != n or not all(isinstance(s, int | float) and not isinstance(s, bool) for s in scores):
        raise ValueError(f"response 'scores' must be {n} numbers, got {str(scores)[:200]}")

    def arr(v: list[Any]) -> np.ndarray:
        return np.array([np.nan if x is None else x for x in v], dtype=np.float32)

    comps = body.get("components") or {}
    if not isinstance(comps, dict) or any(not isinstance(v, list) or len(v) != n for v in comps.values()):
        raise ValueError(f"response 'components' must map names to lists of {n} numbers")
    metrics = body.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise ValueError("response 'metrics' must be an object")
    out_scores = np.array(scores, dtype=np.float32)
    if not np.isfinite(out_scores).all():
        raise ValueError("response 'scores' contains non-finite values")
    return RewardOutput(
        scores=out_scores,
        components={k: arr(v) for k, v in comps.items()},
        metrics={k: (float("nan") if v is None else float(v)) for k, v in metrics.items()},
    )


# ---------------------------------------------------------------------------------------------- HTTP


async def post_json(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    parse: Callable[[Any], T],
    *,
    timeout_s: float,
    max_retries: int,
    backoff_s: float,
    max_backoff_s: float = 10.0,
) -> tuple[T, int]:
    """POST payload as JSON and parse the reply, retrying transient failures; -> (parsed, retries used).

    Retried (at most max_retries times, sleeping backoff_s * 2^k, capped): connection errors, timeouts,
    HTTP 5xx and replies `parse` rejects. Not retried: HTTP 4xx (the request itself is wrong; 401 raises
    Unauthorized, naming FGRPO_REWARD_TOKEN). Raises RewardServiceError naming the URL, the attempts and
    the last error.
    """
    if max_retries < 0 or timeout_s <= 0:
        raise ValueError(f"need max_retries >= 0 and timeout_s > 0, got {max_retries}, {timeout_s}")
    data = json.dumps(payload)  # serialize once: retries resend the same bytes
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    last = ""
    for attempt in range(max_retries + 1):
        if attempt:
            await asyncio.sleep(min(backoff_s * 2 ** (attempt - 1), max_backoff_s))
        try:
            async with session.post(
                url, data=data, headers={"Content-Type": "application/json"}, timeout=timeout
            ) as resp:
                text = await resp.text()
                if resp.status == 401:
                    raise unauthorized(url, token_sent="Authorization" in session.headers)
                if 400 <= resp.status < 500:
                    raise NonRetryableError(
                        f"{url} rejected the request with HTTP {resp.status}: {text[:500]}"
                    )
                if resp.status != 200:
                    last = f"HTTP {resp.status}: {text[:300]}"
                    continue
                try:
                    return parse(json.loads(text)), attempt
                except (ValueError, TypeError, KeyError, IndexError) as e:
                    last = f"malformed response ({e}): {text[:200]!r}"
                    continue
        except NonRetryableError:
            raise
        except TimeoutError:
            last = f"no reply within timeout_s={timeout_s}"
        except aiohttp.ClientError as e:
            last = f"{type(e).__name__}: {e}"
    raise RewardServiceError(f"{url} failed after {max_retries + 1} attempts; last error: {last}")


def run_sync(make_coro: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion from sync code, also when the caller already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())  # type: ignore[arg-type]
    with concurrent.futures.ThreadPoolExecutor(1) as ex:  # asyncio.run refuses to nest in a running loop
        return ex.submit(lambda: asyncio.run(make_coro())).result()  # type: ignore[arg-type]
