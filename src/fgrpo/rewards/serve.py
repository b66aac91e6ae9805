"""Serve any configured reward over HTTP (aiohttp.web); the client is fgrpo.rewards.client.HttpReward.

    python -m fgrpo.rewards.serve --reward ocr --port 8765
    python -m fgrpo.rewards.serve --reward '[{"name": "ocr"}, {"name": "jpeg_compressibility", "weight": 0.1, "required": false}]'
    FGRPO_REWARD_TOKEN=... python -m fgrpo.rewards.serve --reward ocr --host 0.0.0.0

Binds 127.0.0.1 unless --host says otherwise; any other interface needs a token (--token-file PATH or the
environment variable FGRPO_REWARD_TOKEN), and every request must then carry `Authorization: Bearer <token>`
(HttpReward sends FGRPO_REWARD_TOKEN's value), else 401. Wire format: see fgrpo.rewards.transport.
The event loop only moves bytes: a body is counted, parsed and its images decoded in one worker thread,
and requests are scored one at a time in another, so /health answers while a batch is uploaded, parsed or
scored, and a reward that is not thread-safe stays safe.
Status codes: 400 malformed request, 401 no or wrong token, 413 body over --max-request-mb, more JSON
values than --max-images samples need or more images than --max-images, 422 an image over --max-pixels
(checked from its header, before decoding) or the reward rejected the input (ValueError/TypeError), 500 the
reward failed. The client retries only 500; every error body is JSON {"error": message}. /health reports
the limits.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import errno
import hmac
import ipaddress
import logging
import os
import re
import sys
import time
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from fgrpo.errors import FgrpoError
from fgrpo.rewards.base import Reward
from fgrpo.rewards.factory import build_reward
from fgrpo.rewards.transport import (
    TOKEN_ENV,
    ImageTooLarge,
    TooManyImages,
    TooManyValues,
    output_to_json,
    request_from_bytes,
)

log = logging.getLogger("fgrpo.rewards.serve")

# aiohttp's default of 1 MiB is smaller than one batch of PNGs. 16 images of 512^2 (the client's default
# batch_size at the recipes' size) are at most ~17 MB in base64 even as noise; a larger cap only lets one
# request hold more memory and parsing time.
MAX_REQUEST_BYTES = 64 << 20
# 2048^2 = 4.2 MP: 2.4x Qwen-Image's native 1328^2 (1.76 MP; its widest buckets such as 1664x928 are
# smaller) and 4x SD3.5's 1024^2, while one decoded RGB image stays under 13 MB.
MAX_PIXELS = 2048 * 2048
# 4x the client's default batch_size of 16; with MAX_PIXELS a request decodes to at most ~0.8 GB.
MAX_IMAGES = 64
# JSON values a request may hold per sample it may hold: an image, a prompt and a metadata object need a
# handful; 1024 leaves room for rich metadata while json.loads of the most a request may hold (~66 k values
# at the default --max-images) takes milliseconds.
JSON_VALUES_PER_SAMPLE = 1024


class ServiceConfigError(FgrpoError, ValueError):
    """The service cannot start as asked (a missing token beyond loopback, a port in use, a bad token file)."""


def max_json_values(max_images: int) -> int:
    """The most JSON values a /score body may hold when requests hold at most `max_images` samples."""
    return JSON_VALUES_PER_SAMPLE * (max_images + 1)


def _check_limits(max_images: int, max_pixels: int, max_request_bytes: int) -> None:
    for flag, value in (
        ("--max-images", max_images),
        ("--max-pixels", max_pixels),
        ("--max-request-mb", max_request_bytes),
    ):
        if value < 1:
            raise ServiceConfigError(f"reward service: {flag} must be positive, got {value}")


def is_loopback(host: str) -> bool:
    """True for the names and addresses of this machine's loopback interface, which no other machine reaches."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_token(token: str, source: str) -> str:
    """`token` if it can travel in an HTTP header; else ServiceConfigError naming `source`."""
    if not re.fullmatch(r"[\x21-\x7e]+", token):
        raise ServiceConfigError(
            f"reward service: the token from {source} must be printable ASCII without spaces (got "
            f"{len(token)} characters); write one, e.g. python -c 'import secrets; print(secrets.token_urlsafe())'"
        )
    return token


def read_token(token_file: str | None) -> str | None:
    """The service's token: the first line of `token_file` if given, else FGRPO_REWARD_TOKEN, else None."""
    if token_file is not None:
        try:
            text = Path(token_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ServiceConfigError(
                f"reward service: cannot read --token-file {token_file} ({type(e).__name__}: {e})"
            ) from None
        return check_token(text.strip(), f"--token-file {token_file}")
    token = os.environ.get(TOKEN_ENV, "").strip()
    return check_token(token, TOKEN_ENV) if token else None


def make_app(
    reward: Reward,
    name: str = "reward",
    *,
    max_images: int = MAX_IMAGES,
    max_pixels: int = MAX_PIXELS,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    token: str | None = None,
) -> web.Application:
    """An aiohttp application serving `reward` at POST /score and GET /health.

    Requests over a limit are refused before any image is decoded: a body over `max_request_bytes`, with
    more JSON values than `max_images` samples need (counted before parsing) or more than `max_images`
    images with 413, an image whose header declares more than `max_pixels` with 422. With a `token`, every
    request without the header `Authorization: Bearer <token>` gets 401 before its body is read.
    """
    _check_limits(max_images, max_pixels, max_request_bytes)
    max_values = max_json_values(max_images)
    # One thread each: a second request is parsed while the first is scored, and at most one body is
    # decoded at a time.
    parse_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="parse")
    score_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="score")
    stats = {"requests": 0, "images": 0}
    limits = {
        "max_images": max_images,
        "max_pixels": max_pixels,
        "max_request_bytes": max_request_bytes,
        "max_json_values": max_values,
    }

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "reward": name, **stats, **limits})

    async def score(request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        try:
            data = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return web.json_response(
                {
                    "error": f"the request body is over {max_request_bytes:,} bytes (--max-request-mb "
                    f"{max_request_bytes / 2**20:g}); lower the client's batch_size or restart the service "
                    "with a larger --max-request-mb"
                },
                status=413,
            )
        except ConnectionResetError as e:  # the client went away: nothing broken here, one line is enough
            log.warning("client %s disconnected during its /score upload (%s)", request.remote, e)
            # aiohttp drops an answer to a closed connection silently; raising would log a traceback.
            return web.json_response({"error": "connection lost during the upload"}, status=400)
        try:
            images, prompts, metadata = await loop.run_in_executor(
                parse_pool,
                lambda: request_from_bytes(
                    data, max_values=max_values, max_images=max_images, max_pixels=max_pixels
                ),
            )
        except TooManyValues as e:
            return web.json_response(
                {
                    "error": f"{e}, more than {max_images} samples need (--max-images {max_images}); send "
                    "one image, prompt and metadata object per sample, or lower the client's batch_size"
                },
                status=413,
            )
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
            out = await loop.run_in_executor(score_pool, reward, images, prompts, metadata)
        except (ValueError, TypeError) as e:
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=422)
        except Exception as e:
            log.exception("reward failed on a batch of %d", len(images))
            return web.json_response({"error": f"reward failed: {type(e).__name__}: {e}"}, status=500)
        stats["requests"] += 1
        stats["images"] += len(images)
        out.metrics["serve/time_per_image_s"] = (time.perf_counter() - t0) / max(len(images), 1)
        return web.json_response(output_to_json(out))

    middlewares = [] if token is None else [_require_token(check_token(token, "make_app(token=...)"))]

    async def shutdown(app: web.Application) -> None:
        parse_pool.shutdown(wait=False, cancel_futures=True)
        score_pool.shutdown(wait=False, cancel_futures=True)

    app = web.Application(client_max_size=max_request_bytes, middlewares=middlewares)
    app.add_routes([web.get("/health", health), web.post("/score", score)])
    app.on_cleanup.append(shutdown)
    return app


def _require_token(token: str) -> Middleware:
    """Middleware answering 401 to a request whose Authorization header is not `Bearer <token>`."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        got = request.headers.get("Authorization", "").encode("utf-8", "replace")
        if not hmac.compare_digest(got, expected):  # constant time: the answer's timing tells nothing
            return web.json_response(
                {
                    "error": f"this reward service needs the header 'Authorization: Bearer <token>'; fgrpo "
                    f"clients send the value of {TOKEN_ENV}"
                },
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return require_token


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m fgrpo.rewards.serve", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--reward", required=True, help="reward spec for build_reward: a name or a JSON spec")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind (default: loopback only); any other needs a token",
    )
    p.add_argument("--port", type=int, default=8765)
    p.add_argument(
        "--token-file",
        default=None,
        help=f"file whose first line is the token clients must send as 'Authorization: Bearer <token>' "
        f"(default: the environment variable {TOKEN_ENV}; none: no token, loopback only)",
    )
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
    limits = dict(
        max_images=args.max_images,
        max_pixels=args.max_pixels,
        max_request_bytes=int(args.max_request_mb * 2**20),
    )
    _check_limits(**limits)  # before building the reward (OCR models load for seconds)
    token = read_token(args.token_file)
    if token is None and not is_loopback(args.host):
        raise ServiceConfigError(
            f"reward service: --host {args.host} reaches beyond this machine and the service has no token; "
            f"give one with --token-file PATH or {TOKEN_ENV} (clients send it from {TOKEN_ENV}), or bind "
            "--host 127.0.0.1"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    reward = build_reward(args.reward)  # before binding: a bad spec fails before anyone can connect
    app = make_app(reward, args.reward, **limits, token=token)
    log.info(
        "serving reward %s on http://%s:%d (%s)",
        args.reward,
        args.host,
        args.port,
        "token required" if token else "no token: loopback only",
    )
    try:
        web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    except OSError as e:
        fixes = {
            errno.EADDRINUSE: f"port {args.port} is already in use; stop what holds it or choose another "
            "with --port",
            errno.EACCES: f"binding port {args.port} is not permitted; choose one above 1023 with --port",
            errno.EADDRNOTAVAIL: f"{args.host} is no address of this machine; choose another with --host",
        }
        if e.errno not in fixes:
            raise
        raise ServiceConfigError(f"reward service: {fixes[e.errno]} ({e.strerror})") from None


def cli(argv: list[str] | None = None) -> None:
    """`main`, printing an error fgrpo raises on purpose as its one line and exiting with its exit_code."""
    try:
        main(argv)
    except FgrpoError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    cli()
