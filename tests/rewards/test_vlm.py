"""VLM OCR engines. vLLM cannot run on a CPU machine, so VlmOcrEngine (the openai client) is tested against a
fake OpenAI-compatible chat server on 127.0.0.1 (aiohttp.web) that checks each request and answers with the
text stored for the image it decodes; VllmOcrEngine against a stub `vllm` module."""

from __future__ import annotations

import asyncio
import base64
import sys
import types

import numpy as np
import pytest
from aiohttp import web

from fgrpo.rewards import build_reward
from fgrpo.rewards.ocr import OcrReward
from fgrpo.rewards.transport import RewardServiceError, decode_image
from fgrpo.rewards.vlm import DEFAULT_PROMPT, VllmOcrEngine, VlmOcrEngine

from .helpers import serve_in_thread

rng = np.random.default_rng(0)
IMAGES = rng.integers(0, 256, (5, 12, 10, 3), dtype=np.uint8)
TEXTS = ["STOP", "Sale", "hello world", "", "open"]  # what the fake VLM "reads" in each image
PROMPTS = ['"stop"', '"sale"', '"Hello World"', '"x"', '"closed"']
SCORES = [1, 1, 1, 0, 1 - 4 / 6]  # ocr_score of TEXTS against PROMPTS' targets


def fake_openai(log: dict, *, fail_first: int = 0, status: int = 500, reply=None, delay_s: float = 0.0):
    """A chat-completions endpoint that validates the request and transcribes by looking the image up.
    Its first `fail_first` requests get `status`, with Retry-After 1 ms so the client's retry is quick."""
    log.update(requests=0, in_flight=0, max_in_flight=0, auth=set())

    async def chat(request: web.Request) -> web.Response:
        log["requests"] += 1
        log["auth"].add(request.headers.get("Authorization"))
        if log["requests"] <= fail_first:
            return web.json_response({"error": "overloaded"}, status=status, headers={"retry-after-ms": "1"})
        body = await request.json()
        log["in_flight"] += 1
        log["max_in_flight"] = max(log["max_in_flight"], log["in_flight"])
        try:
            await asyncio.sleep(delay_s)
            assert body["model"] == "test-vlm" and body["temperature"] == 0.0 and body["max_tokens"] == 64
            (msg,) = body["messages"]
            image_part, text_part = msg["content"]
            assert text_part == {"type": "text", "text": DEFAULT_PROMPT}
            url = image_part["image_url"]["url"]
            assert url.startswith("data:image/png;base64,")
            image = decode_image(base64.b64decode(url.split(",", 1)[1]))
            (idx,) = [i for i, im in enumerate(IMAGES) if np.array_equal(im, image)]  # PNG is lossless
        finally:
            log["in_flight"] -= 1
        if reply is not None:
            return web.Response(text=reply, content_type="application/json")
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": TEXTS[idx]}}]})

    app = web.Application(client_max_size=1 << 26)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def test_vlm_engine_against_fake_server_scores_like_ocr():
    log: dict = {}
    with serve_in_thread(fake_openai(log, delay_s=0.05)) as url:
        engine = VlmOcrEngine(url + "/v1", "test-vlm", max_concurrency=2)
        assert engine.recognize(IMAGES) == TEXTS  # order kept despite concurrency
        out = OcrReward(engine)(IMAGES, PROMPTS)
    np.testing.assert_allclose(out.scores, SCORES, rtol=1e-6)
    assert log["max_in_flight"] == 2  # concurrent, and bounded by max_concurrency
    assert log["auth"] == {"Bearer EMPTY"}  # vLLM's placeholder key when none is given


def test_vlm_reward_from_a_spec_sends_the_api_key():
    log: dict = {}
    with serve_in_thread(fake_openai(log)) as url:
        spec = {"name": "ocr", "engine": "vlm", "base_url": url, "model": "test-vlm", "api_key": "k1"}
        out = build_reward(spec)(IMAGES, PROMPTS)
    np.testing.assert_allclose(out.scores, SCORES, rtol=1e-6)
    assert log["auth"] == {"Bearer k1"}


def test_vlm_engine_retries_a_500_then_succeeds():
    log: dict = {}
    with serve_in_thread(fake_openai(log, fail_first=2)) as url:
        engine = VlmOcrEngine(url, "test-vlm", max_concurrency=1, max_retries=2)
        assert engine.recognize(IMAGES[:1]) == TEXTS[:1]
    assert log["requests"] == 3


def test_vlm_engine_gives_up_after_its_retries_with_the_status():
    log: dict = {}
    with serve_in_thread(fake_openai(log, fail_first=10, status=503)) as url:
        engine = VlmOcrEngine(url, "test-vlm", max_retries=1)
        with pytest.raises(RewardServiceError, match=r"answered HTTP 503 .*\(2 attempt\(s\)\)"):
            engine.recognize(IMAGES[:1])
    assert log["requests"] == 2


def test_vlm_engine_does_not_retry_a_bad_request():
    log: dict = {}
    with serve_in_thread(fake_openai(log, fail_first=10, status=404)) as url:
        with pytest.raises(RewardServiceError, match="answered HTTP 404"):
            VlmOcrEngine(url, "test-vlm", max_retries=3).recognize(IMAGES[:1])
    assert log["requests"] == 1


def test_vlm_engine_timeout_is_a_clear_error():
    """Each attempt waits timeout_s, then the client retries (timeouts are retried) and gives up."""
    log: dict = {}
    with serve_in_thread(fake_openai(log, delay_s=0.6)) as url:
        engine = VlmOcrEngine(url, "test-vlm", timeout_s=0.2, max_retries=1)
        with pytest.raises(RewardServiceError, match=r"timed out \(2 attempt\(s\) of timeout_s=0.2\)"):
            engine.recognize(IMAGES[:1])  # the reply would come after 0.6 s and succeed
    assert log["requests"] == 2


@pytest.mark.parametrize(
    "reply", ['{"choices": []}', "not json", '{"choices": [{"message": {"content": 3}}]}']
)
def test_vlm_engine_malformed_reply_is_a_clear_error(reply):
    log: dict = {}
    with serve_in_thread(fake_openai(log, reply=reply)) as url:
        engine = VlmOcrEngine(url, "test-vlm", max_retries=1)
        with pytest.raises(RewardServiceError, match="malformed response"):
            engine.recognize(IMAGES[:1])
    assert log["requests"] == 1  # the same request would get the same answer


def test_vlm_engine_down_is_a_clear_error():
    engine = VlmOcrEngine("http://127.0.0.1:9", "test-vlm", max_retries=1, timeout_s=2)
    with pytest.raises(
        RewardServiceError, match="127.0.0.1:9/v1/chat/completions unreachable after 2 attempt"
    ):
        engine.recognize(IMAGES[:1])


def test_vllm_engine_without_vllm_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match="uv sync --extra vllm"):
        VllmOcrEngine("some/model")


def test_vllm_engine_with_stub_module(monkeypatch):
    calls = {}

    class LLM:
        def __init__(self, model, **kw):
            calls["init"] = (model, kw)

        def chat(self, conversations, sampling, use_tqdm):
            calls["chat"] = (conversations, sampling)
            return [
                types.SimpleNamespace(outputs=[types.SimpleNamespace(text=t)])
                for t in TEXTS[: len(conversations)]
            ]

    stub = types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", stub)
    engine = VllmOcrEngine("Qwen/Qwen2.5-VL-3B-Instruct", gpu_memory_utilization=0.2)
    assert engine.recognize(IMAGES[:3]) == TEXTS[:3]
    assert calls["init"] == ("Qwen/Qwen2.5-VL-3B-Instruct", {"gpu_memory_utilization": 0.2})
    conversations, sampling = calls["chat"]
    assert sampling == {"temperature": 0.0, "max_tokens": 64}
    url = conversations[1][0]["content"][0]["image_url"]["url"]
    np.testing.assert_array_equal(decode_image(base64.b64decode(url.split(",", 1)[1])), IMAGES[1])
