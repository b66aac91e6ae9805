"""Serve any configured reward over HTTP (aiohttp.web); the client is fgrpo.rewards.client.HttpReward.

    python -m fgrpo.rewards.serve --reward ocr --port 8765
    python -m fgrpo.rewards.serve --reward '[{"name": "ocr"}, {"name": "jpeg_compressibility", "weight": 0.1, "required": false}]'

Binds 127.0.0.1 unless --host says otherwise (the service has no authentication). Wire format: see
fgrpo.rewards.transport. Requests are scored one at a time in a worker thread, so the event loop keeps
answering /health while a batch is being scored, and a reward that is not thread-safe stays safe.
Status codes: 400 malformed request, 422 the reward rejected the input (ValueError/TypeError: not retried
by the client), 500 the reward failed (retried by the client).
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
from fgrpo.rewards.transport import output_to_json, request_from_json

log = logging.getLogger("fgrpo.rewards.serve")

MAX_REQUEST_BYTES = 1 << 30  # aiohttp's default of 1 MiB is smaller than one batch of PNGs


def make_app(reward: Reward, name: str = "reward") -> web.Application:
    """An aiohttp application serving `reward` at POST /score and GET /health."""
    pool = cf.ThreadPoolExecutor(1, thread_name_prefix="score")
    stats = {"requests": 0, "images": 0}

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "reward": name, **stats})

    async def score(request: web.Request) -> web.Response:
        try:
            images, prompts, metadata = request_from_json(await request.json())
        except (ValueError, json.JSONDecodeError) as e:
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

    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app.add_routes([web.get("/health", health), web.post("/score", score)])
    app.on_cleanup.append(shutdown)
    return app


def main(argv: list[str] | None = None) -> None:
    from fgrpo.rewards.factory import build_reward

    p = argparse.ArgumentParser(prog="python -m fgrpo.rewards.serve", description=__doc__.split("\n")[0])
    p.add_argument("--reward", required=True, help="reward spec for build_reward: a name or a JSON spec")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    reward = build_reward(args.reward)  # before binding: a bad spec fails before anyone can connect
    log.info("serving reward %s on http://%s:%d", args.reward, args.host, args.port)
    web.run_app(make_app(reward, args.reward), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
