"""Serve any configured reward over HTTP (aiohttp.web); the client is fgrpo.rewards.client.HttpReward.

    python -m fgrpo.rewards.serve --reward ocr --port 8765
    python -m fgrpo.rewards.serve --reward '[{"name": "ocr"}, {"name": "jpeg_compressibility", "weight": 0.1, "required": false}]'

Binds 127.0.0.1 unless --host says otherwise (the service has no authentication). Wire format: see
fgrpo.rewards.transport. Requests are scored one at a time in a worker thread, so the event loop keeps
answering /health while a batch is being scored, and a reward that is not thread-safe stays safe.
Status codes: 400 malformed request, 413 body over --max-request-mb or more images than --max-images,
422 an image over --max-pixels (checked from its header, before decoding) or the reward rejected the input
(ValueError/TypeError), 500 the reward failed. The client retries only 500; every error body is JSON
{"error": message}. /health reports the limits.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import json
import logging
import time

from aiohttp import web

from fgrpo.rewards.base import Reward
from fgrpo.rewards.transport import ImageTooLarge, TooManyImages, output_to_json, request_from_json

log = logging.getLogger("fgrpo.rewards.serve")

# aiohttp's default of 1 MiB is smaller than one batch of PNGs; 64 noisy 1328^2 PNGs are ~450 MB in base64.
MAX_REQUEST_BYTES = 1 << 30
# 2048^2 = 4.2 MP: 2.4x Qwen-Image's native 1328^2 (1.76 MP; its widest buckets such as 1664x928 are
# smaller) and 4x SD3.5's 1024^2, while one decoded RGB image stays under 13 MB.
MAX_PIXELS = 2048 * 2048
# 4x the client's default batch_size of 16; with MAX_PIXELS a request decodes to at most ~0.8 GB.
MAX_IMAGES = 64


def _check_limits(max_images: int, max_pixels: int, max_request_bytes: int) -> None:
    for flag, value in (
        ("--max-images", max_images),
        ("--max-pixels", max_pixels),
        ("--max-request-mb", max_request_bytes),
    ):
        if value < 1:
            raise ValueError(f"reward service: {flag} must be positive, got {value}")


def make_app(
    reward: Reward,
    name: str = "reward",
    *,
    max_images: int = MAX_IMAGES,
    max_pixels: int = MAX_PIXELS,
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> web.Application:
    """An aiohttp application serving `reward` at POST /score and GET /health.

    Requests over a limit are refused before any image is decoded: more than `max_images` images or a
    body over `max_request_bytes` with 413, an image whose header declares more than `max_pixels` with 422.
    """
    _check_limits(max_images, max_pixels, max_request_bytes)
    pool = cf.ThreadPoolExecutor(1, thread_name_prefix="score")
    stats = {"requests": 0, "images": 0}
    limits = {"max_images": max_images, "max_pixels": max_pixels, "max_request_bytes": max_request_bytes}

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "reward": name, **stats, **limits})

    async def score(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            return web.json_response(
                {
                    "error": f"the request body is over {max_request_bytes:,} bytes (--max-request-mb "
                    f"{max_request_bytes / 2**20:g}); lower the client's batch_size or restart the service "
                    "with a larger --max-request-mb"
                },
                status=413,
            )
        except json.JSONDecodeError as e:
            return web.json_response({"error": f"bad request: {e}"}, status=400)
        try:
            images, prompts, metadata = request_from_json(body, max_images=max_images, max_pixels=max_pixels)
        except TooManyImages as e:
            return web.json_response(
                {"error": f"{e} (--max-images {max_images}); lower the client's batch_size"}, status=413
            )
        except ImageTooLarge as e:
            return web.json_response(
                {
                    "error": f"{e} (--max-pixels {max_pixels}); send smaller images or restart the service "
                    "with a larger --max-pixels"
                },
                status=422,
            )
        except ValueError as e:
            return web.json_response({"error": f"bad request: {e}"}, status=400)
        t0 = time.perf_counter()
        try:
            out = await asyncio.get_running_loop().run_in_executor(pool, reward, images, prompts, metadata)
        except (ValueError, TypeError) as e:
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=422)
        except Exception as e:
            log.exception("reward failed on a batch of %d", len(images))
            return web.json_response({"error": f"reward failed: {type(e).__name__}: {e}"}, status=500)
        stats["requests"] += 1
        stats["images"] += len(images)
        out.metrics["serve/time_per_image_s"] = (time.perf_counter() - t0) / max(len(images), 1)
        return web.json_response(output_to_json(out))

    async def shutdown(app: web.Application) -> None:
        pool.shutdown(wait=False, cancel_futures=True)

    app = web.Application(client_max_size=max_request_bytes)
    app.add_routes([web.get("/health", health), web.post("/score", score)])
    app.on_cleanup.append(shutdown)
    return app


def main(argv: list[str] | None = None) -> None:
    from fgrpo.rewards.factory import build_reward

    p = argparse.ArgumentParser(
        prog="python -m fgrpo.rewards.serve", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--reward", required=True, help="reward spec for build_reward: a name or a JSON spec")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument(
        "--max-images",
        type=int,
        default=MAX_IMAGES,
        help=f"images per request (default {MAX_IMAGES}); more: HTTP 413",
    )
    p.add_argument(
        "--max-pixels",
        type=int,
        default=MAX_PIXELS,
        help=f"pixels per image, width * height (default {MAX_PIXELS} = 2048^2); more: HTTP 422, before decoding",
    )
    p.add_argument(
        "--max-request-mb",
        type=float,
        default=MAX_REQUEST_BYTES / 2**20,
        help=f"request body size in MiB (default {MAX_REQUEST_BYTES / 2**20:g}); more: HTTP 413",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    limits = dict(
        max_images=args.max_images,
        max_pixels=args.max_pixels,
        max_request_bytes=int(args.max_request_mb * 2**20),
    )
    _check_limits(**limits)  # before building the reward (OCR models load for seconds)
    reward = build_reward(args.reward)  # before binding: a bad spec fails before anyone can connect
    app = make_app(reward, args.reward, **limits)
    log.info("serving reward %s on http://%s:%d", args.reward, args.host, args.port)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
