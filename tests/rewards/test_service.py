"""HTTP reward service and its client, on loopback only: a round trip equals the local reward; faults
(service killed mid-batch, slower than the timeout, malformed reply, HTTP 500) are retried a bounded
number of times and then raise a clear error; a restarted service is picked up again. Limits, /health during
a request, the token and start-up errors: the CLI runs up to binding with web.run_app replaced, so nothing
is ever bound beyond loopback."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from fgrpo.rewards import HttpReward, RewardServiceError
from fgrpo.rewards.base import RewardOutput
from fgrpo.rewards.multi import Member, MultiReward
from fgrpo.rewards.ocr import OcrReward
from fgrpo.rewards.serve import make_app
from fgrpo.rewards.transport import TOKEN_ENV, NonRetryableError, output_to_json

from .helpers import serve_in_thread
from .slow_reward import SlowMeanPixel, mean_pixel

rng = np.random.default_rng(0)
IMAGES = rng.integers(0, 256, (7, 24, 20, 3), dtype=np.uint8)
PROMPTS = [f'p{i} "x"' for i in range(7)]


def client(url: str, **kw) -> HttpReward:
    kw = {"timeout_s": 10.0, "max_retries": 2, "backoff_s": 0.01, "batch_size": 3} | kw
    return HttpReward(url, **kw)


class MetaReward:
    """Scores metadata["w"] * mean pixel."""

    def __call__(self, images, prompts, metadata=None):
        assert metadata is not None  # this reward needs it
        w = np.array([m["w"] for m in metadata], np.float32)
        return RewardOutput(scores=w * mean_pixel(images), metrics={"meta/seen_count": float(len(images))})


class NanOnOdd:  # an optional member that fails on samples with odd metadata["w"]
    def __call__(self, images, prompts, metadata=None):
        assert metadata is not None  # this reward needs it
        w = np.array([m["w"] for m in metadata])
        return RewardOutput(scores=np.where(w % 2 == 1, np.nan, 1.0).astype(np.float32))


def test_round_trip_equals_local_reward_in_batches():
    reward = MultiReward([Member("meta", MetaReward(), 2.0), Member("odd", NanOnOdd(), 1.0, required=False)])
    meta = [{"w": float(i)} for i in range(7)]
    local = reward(IMAGES, PROMPTS, meta)
    with serve_in_thread(make_app(reward, "test")) as url:
        c = client(url)
        assert c.health()["status"] == "ok"
        remote = c(IMAGES, PROMPTS, meta)
        stats = c.health()
    np.testing.assert_array_equal(remote.scores, local.scores)  # PNG is lossless: bit-exact
    for k in local.components:  # NaN (excluded member) survives JSON as null
        np.testing.assert_array_equal(remote.components[k], local.components[k])
    assert stats["requests"] == 3 and stats["images"] == 7  # batches of 3 + 3 + 1
    assert remote.metrics["meta/meta/seen_count"] == 7  # *_count metrics add up across batches
    assert remote.metrics["http/retry_count"] == 0


def test_jpeg_transport_is_lossy_but_close():
    smooth = np.repeat(np.linspace(0, 255, 20, dtype=np.uint8)[None, None, :, None], 24, axis=1).repeat(3, -1)
    images = np.repeat(smooth, 7, axis=0)
    with serve_in_thread(make_app(SlowMeanPixel(0.0))) as url:
        out = client(url, image_format="jpeg")(images, PROMPTS)
    np.testing.assert_allclose(out.scores, mean_pixel(images), atol=2 / 255)


def test_rejected_input_is_not_retried():
    class NoOcr:
        def recognize(self, images):
            raise AssertionError("OCR must not run on a bad prompt")

    with serve_in_thread(make_app(OcrReward(NoOcr()))) as url:
        with pytest.raises(NonRetryableError, match="HTTP 422.*no text between double quotes"):
            client(url)(IMAGES[:2], ['ok "a"', "no quotes"])


def test_client_and_cli_fail_before_any_network_on_bad_input():
    from fgrpo.rewards.serve import main

    with pytest.raises(TypeError, match="JSON-serializable"):
        client("http://127.0.0.1:9")(IMAGES[:1], PROMPTS[:1], [{"array": np.zeros(2)}])
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        main(["--reward", "nope", "--port", "9"])


def counting_app(handler_reply, log: dict) -> web.Application:
    """A /score endpoint whose reply is chosen per attempt by handler_reply(attempt, n_images)."""
    log["requests"] = 0

    async def score(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        log["requests"] += 1
        return await handler_reply(log["requests"], len(body["images"]))

    app = web.Application(client_max_size=1 << 26)
    app.router.add_post("/score", score)
    return app


def ok(n: int) -> web.Response:
    return web.json_response(output_to_json(RewardOutput(scores=np.full(n, 0.25, np.float32))))


async def always_500(attempt, n):
    return web.json_response({"error": "boom"}, status=500)


async def fail_once(attempt, n):
    return web.json_response({"error": "boom"}, status=500) if attempt == 1 else ok(n)


async def wrong_length(attempt, n):
    return web.json_response({"scores": [0.5] * (n + 1)})


async def not_json(attempt, n):
    return web.Response(text="<html>proxy error</html>", status=200)


async def too_slow(attempt, n):
    import asyncio

    await asyncio.sleep(1.0)
    return ok(n)


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (always_500, "HTTP 500"),
        (wrong_length, "malformed response.*must be 2 numbers"),
        (not_json, "malformed response"),
        (too_slow, "no reply within timeout_s=0.2"),
    ],
)
def test_faults_are_retried_then_raise_clearly(reply, message):
    log: dict = {}
    with serve_in_thread(counting_app(reply, log)) as url:
        with pytest.raises(RewardServiceError, match=f"after 3 attempts; last error: {message}") as e:
            client(url, timeout_s=0.2, batch_size=2)(IMAGES[:2], PROMPTS[:2])
    assert log["requests"] == 3  # 1 try + max_retries=2, then stop: bounded
    assert "Is it running?" in str(e.value)


def test_transient_500_is_retried_and_succeeds():
    log: dict = {}
    with serve_in_thread(counting_app(fail_once, log)) as url:
        out = client(url, batch_size=2)(IMAGES[:2], PROMPTS[:2])
    np.testing.assert_array_equal(out.scores, [0.25, 0.25])
    assert out.metrics["http/retry_count"] == 1 and log["requests"] == 2


def test_service_down_is_a_clear_error():
    port = _free_port()
    c = client(f"http://127.0.0.1:{port}")
    with pytest.raises(RewardServiceError, match="is not up.*python -m fgrpo.rewards.serve"):
        c.health()
    with pytest.raises(RewardServiceError, match=f"127.0.0.1:{port}/score failed after 3 attempts"):
        c(IMAGES, PROMPTS)


# ------------------------------------------------------------------------------- a real serve process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_service(port: int) -> subprocess.Popen:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    )
    spec = json.dumps({"name": "slow_reward:make", "sleep_s": 0.4})
    proc = subprocess.Popen(
        [sys.executable, "-m", "fgrpo.rewards.serve", "--reward", spec, "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # bounded wait for /health
        if proc.poll() is not None:
            assert proc.stderr is not None  # stderr=PIPE
            raise RuntimeError(f"serve exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("serve did not become healthy within 30 s")


def _health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
        return json.loads(r.read())


def test_service_killed_mid_batch_then_restart_is_picked_up():
    port = _free_port()
    proc = _start_service(port)
    c = client(f"http://127.0.0.1:{port}", batch_size=2, max_concurrency=1, max_retries=2, backoff_s=0.05)

    def kill_after_first_batch() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _health(port)["requests"] < 1:
            time.sleep(0.02)
        proc.kill()  # 4 requests of 0.4 s each: this lands while a later one is being scored

    killer = threading.Thread(target=kill_after_first_batch)
    try:
        killer.start()
        with pytest.raises(RewardServiceError, match="after 3 attempts") as e:
            c(IMAGES, PROMPTS)
        killer.join(20)
        assert proc.wait(10) != 0
        assert f"127.0.0.1:{port}" in str(e.value)

        proc = _start_service(port)  # same port: the same client object must work again
        out = c(IMAGES, PROMPTS)
        np.testing.assert_allclose(out.scores, mean_pixel(IMAGES), rtol=1e-6)
        assert out.metrics["slow/calls_count"] == 4
    finally:
        proc.kill()
        proc.wait(10)


# ------------------------------------------------------------------------------- request size limits


def _post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/score", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _png_b64(size: tuple[int, int], mode: str = "1") -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")  # uniform: tiny on disk whatever its pixel count
    return base64.b64encode(buf.getvalue()).decode()


def test_image_over_the_pixel_cap_is_refused_from_its_header_without_decoding(monkeypatch):
    from PIL import ImageFile

    huge = _png_b64((9000, 9000))
    assert len(huge) < 100_000  # ~81 MP behind a few kB: only the header tells

    real_load = ImageFile.ImageFile.load

    def no_decoding(self):
        assert self.size != (9000, 9000), "the huge image was decoded"
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with serve_in_thread(make_app(SlowMeanPixel(0.0))) as url:
        t0 = time.perf_counter()
        status, body = _post(
            url, json.dumps({"images": [_png_b64((8, 8)), huge], "prompts": ["a", "b"]}).encode()
        )
        assert time.perf_counter() - t0 < 2.0
    assert status == 422
    assert "image 1 is 9000x9000" in body["error"] and "--max-pixels" in body["error"]


def test_too_many_images_or_too_large_a_body_is_413_with_a_json_error():
    small = _png_b64((8, 8), "RGB")
    with serve_in_thread(make_app(SlowMeanPixel(0.0), max_images=2, max_request_bytes=20_000)) as url:
        status, body = _post(url, json.dumps({"images": [small] * 3, "prompts": ["p"] * 3}).encode())
        assert status == 413 and "3 images" in body["error"] and "--max-images 2" in body["error"]
        status, body = _post(url, json.dumps({"images": [small], "prompts": ["x" * 30_000]}).encode())
        assert status == 413 and "--max-request-mb" in body["error"]
        status, _ = _post(url, json.dumps({"images": [small] * 2, "prompts": ["p"] * 2}).encode())
        assert status == 200
        with pytest.raises(NonRetryableError, match="HTTP 413.*batch_size"):  # the client says what to change
            client(url, batch_size=3)(IMAGES[:3], PROMPTS[:3])
        limits = client(url, batch_size=2).health()
        with pytest.raises(RewardServiceError, match="at most 2 images per request.*batch_size=3"):
            client(url, batch_size=3).health()  # before the first rollout, not at the first score
    assert limits["max_images"] == 2 and limits["max_request_bytes"] == 20_000
    assert limits["max_pixels"] == 2048 * 2048


def test_limits_must_be_positive():
    from fgrpo.rewards.serve import main

    with pytest.raises(ValueError, match="--max-images"):
        main(["--reward", "jpeg_compressibility", "--port", "9", "--max-images", "0"])


# ------------------------------------------------------------------------------- availability


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _health_wait_s(url: str) -> float:
    t0 = time.perf_counter()
    status, _ = _get(url + "/health")
    assert status == 200
    return time.perf_counter() - t0


def _post_in_thread(url: str, body: bytes) -> tuple[threading.Thread, dict]:
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(reply=_post(url, body)))
    thread.start()
    return thread, box


def test_health_answers_within_a_second_while_a_body_is_decoded(monkeypatch):
    from fgrpo.rewards import transport

    decoding = threading.Event()
    real_decode = transport.decode_image

    def slow_decode(data, max_pixels=None):  # 3 images: 1.8 s of decoding in all
        decoding.set()
        time.sleep(0.6)
        return real_decode(data, max_pixels)

    monkeypatch.setattr(transport, "decode_image", slow_decode)
    body = json.dumps({"images": [_png_b64((8, 8), "RGB")] * 3, "prompts": ["p"] * 3}).encode()
    with serve_in_thread(make_app(SlowMeanPixel(0.0))) as url:
        thread, box = _post_in_thread(url, body)
        assert decoding.wait(5)
        waits = [_health_wait_s(url) for _ in range(3)]
        thread.join(10)
    assert box["reply"][0] == 200
    assert max(waits) < 1.0, waits


def test_a_body_of_too_many_values_is_refused_before_parsing():
    # 0 images and 2.5 M prompts in 7.5 MB: json.loads alone would hold the GIL for a good part of a second.
    many = b'{"images": [], "prompts": [' + b",".join([b'""'] * 2_500_000) + b"]}"
    with serve_in_thread(make_app(SlowMeanPixel(0.0), max_images=4, max_request_bytes=8 << 20)) as url:
        thread, box = _post_in_thread(url, many)
        waits = [_health_wait_s(url) for _ in range(3)]
        thread.join(10)
        # Commas and brackets inside strings are no values: a long prompt full of them is fine.
        prompt = '"a", [1, {"b": 2}], ' * 2_000
        status, _ = _post(
            url, json.dumps({"images": [_png_b64((8, 8), "RGB")], "prompts": [prompt]}).encode()
        )
        assert status == 200
    status, body = box["reply"]
    assert status == 413, body
    assert "over 5,120 JSON values" in body["error"] and "--max-images 4" in body["error"]
    assert max(waits) < 1.0, waits


def test_count_json_values_skips_strings_and_stops_past_the_limit():
    from fgrpo.rewards.transport import count_json_values

    data = b'{"a": [1, 2, {"b": "x,y[{\\"]"}]}'  # values: a, 1, 2, {...}, b
    assert count_json_values(data, 100) == 8  # under the limit: every comma and bracket, in strings too
    assert count_json_values(data, 5) == 5  # over it: the exact count, strings skipped
    assert count_json_values(b"[" + b",".join([b"1"] * 1000) + b"]", 10) == 11  # stops at limit + 1


def test_the_body_cap_is_64_mib_by_default():
    with serve_in_thread(make_app(SlowMeanPixel(0.0))) as url:
        limits = client(url).health()
    assert limits["max_request_bytes"] == 64 << 20


# ------------------------------------------------------------------------------- access


@pytest.fixture
def no_binding(monkeypatch):
    """web.run_app replaced by a recorder of its arguments: the CLI runs up to binding and binds nothing."""
    calls: list[tuple[web.Application, dict]] = []
    monkeypatch.setattr(web, "run_app", lambda app, **kw: calls.append((app, kw)))
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    return calls


def _exit_line(argv: list[str], capsys) -> str:
    from fgrpo.rewards.serve import cli

    with pytest.raises(SystemExit) as e:
        cli(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err  # one line, no traceback
    return err


def test_serving_beyond_loopback_without_a_token_is_refused_before_binding(no_binding, capsys):
    err = _exit_line(["--reward", "jpeg_compressibility", "--host", "0.0.0.0", "--port", "9"], capsys)
    assert "--host 0.0.0.0" in err and "--token-file" in err and TOKEN_ENV in err
    assert no_binding == []


def test_the_token_from_a_file_or_the_environment_is_enforced(no_binding, capsys, tmp_path, monkeypatch):
    from fgrpo.rewards.serve import cli

    (tmp_path / "token").write_text("file-token\n")
    argv = ["--reward", "jpeg_compressibility", "--port", "9", "--max-request-mb", "8"]
    cli([*argv, "--host", "0.0.0.0", "--token-file", str(tmp_path / "token")])
    monkeypatch.setenv(TOKEN_ENV, "env-token")
    cli(argv)  # loopback, with a token in the environment: enforced too
    (from_file, kw), (from_env, _) = no_binding
    assert kw["host"] == "0.0.0.0"
    for app, token in ((from_file, "file-token"), (from_env, "env-token")):
        with serve_in_thread(app) as url:  # on loopback here: only the app's token check is under test
            assert _get(url + "/health")[0] == 401
            assert _get(url + "/health", {"Authorization": "Bearer env-token file-token"})[0] == 401
            status, limits = _get(url + "/health", {"Authorization": f"Bearer {token}"})
        assert status == 200 and limits["max_request_bytes"] == 8 << 20
    err = _exit_line([*argv, "--token-file", str(tmp_path / "missing")], capsys)
    assert f"--token-file {tmp_path / 'missing'}" in err


def test_a_token_is_required_on_every_route_and_clients_send_it_from_the_environment(monkeypatch):
    from fgrpo.errors import FgrpoError
    from fgrpo.rewards.factory import build_reward
    from fgrpo.rewards.transport import Unauthorized

    app = make_app(SlowMeanPixel(0.0), token="s3cret")
    attempts = {"score": 0}

    @web.middleware
    async def count_score(request, handler):
        attempts["score"] += request.path == "/score"
        return await handler(request)

    app.middlewares.insert(0, count_score)  # outside the token check: it sees the refused requests too
    body = json.dumps({"images": [_png_b64((8, 8), "RGB")], "prompts": ["p"]}).encode()
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with serve_in_thread(app) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            assert _get(url + "/health", headers)[0] == 401
            req = urllib.request.Request(url + "/score", data=body, headers=headers)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 401
            assert "Authorization: Bearer" in json.loads(e.value.read())["error"]
        attempts["score"] = 0
        with pytest.raises(Unauthorized, match=f"/health answered HTTP 401.*{TOKEN_ENV} is not set") as e:
            client(url).health()
        assert isinstance(e.value, FgrpoError)  # printed as one line by an experiment's entry
        with pytest.raises(Unauthorized, match=f"/score answered HTTP 401.*{TOKEN_ENV} is not set"):
            client(url, batch_size=7)(IMAGES, PROMPTS)
        assert attempts["score"] == 1  # not retried
        monkeypatch.setenv(TOKEN_ENV, "wrong")
        with pytest.raises(Unauthorized, match=f"refused the token in {TOKEN_ENV}"):
            client(url)(IMAGES, PROMPTS)
        monkeypatch.setenv(TOKEN_ENV, "s3cret")
        out = client(url)(IMAGES, PROMPTS)
        served = build_reward({"name": "http", "url": url})  # as the training loop builds --reward.url
        assert isinstance(served, HttpReward) and served.health()["images"] == 7
    np.testing.assert_allclose(out.scores, mean_pixel(IMAGES), rtol=1e-6)


def test_loopback_is_told_from_other_hosts():
    from fgrpo.rewards.serve import is_loopback

    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "", "10.0.0.1", "example.org"]))


# ------------------------------------------------------------------------------- errors in one line


def test_a_port_in_use_is_one_line_naming_the_port_and_the_flag(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _exit_line(["--reward", "jpeg_compressibility", "--port", str(port)], capsys)
    assert f"port {port} is already in use" in err and "--port" in err


def test_a_client_that_disconnects_mid_upload_is_one_log_line(caplog):
    caplog.set_level(logging.INFO)
    with serve_in_thread(make_app(SlowMeanPixel(0.0))) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100000\r\n\r\n{"images": ["' + b"A" * 1000
            )
            time.sleep(0.2)  # the handler is reading the body when the connection closes
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not caplog.records:
            time.sleep(0.02)
        time.sleep(0.2)  # a traceback would be logged by now as well
    records = [r for r in caplog.records if r.name.startswith(("aiohttp", "fgrpo"))]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].exc_info is None and "disconnected during its /score upload" in records[0].getMessage()
