"""Test helpers: render text with DejaVu Sans, serve an aiohttp app on 127.0.0.1 from a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from aiohttp import web
from PIL import Image, ImageDraw, ImageFont

from fgrpo.fonts import dejavu_sans

FONT = dejavu_sans()


def render_text(text: str, font_path: Path, size: int = 512, font_size: int = 56) -> np.ndarray:
    """Black text centred on white, uint8 RGB [size, size, 3]."""
    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.truetype(str(font_path), font_size)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(
        ((size - (right - left)) / 2 - left, (size - (bottom - top)) / 2 - top), text, fill="black", font=font
    )
    return np.asarray(img)


@contextlib.contextmanager
def serve_in_thread(app: web.Application) -> Iterator[str]:
    """Run `app` on 127.0.0.1 (a free port) in a daemon thread; yield its base URL; stop it on exit."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    started = threading.Event()
    box: dict[str, object] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            box["port"] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        except BaseException as e:  # surface startup errors in the test, not in the thread
            box["error"] = e
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not started.wait(10) or "error" in box:
        raise RuntimeError(f"test server did not start: {box.get('error')}")
    try:
        yield f"http://127.0.0.1:{box['port']}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
