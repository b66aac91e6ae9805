"""VLM OCR engines. vLLM cannot run on a CPU machine, so VlmOcrEngine (the openai client) is tested against a
fake OpenAI-compatible chat server on 127.0.0.1 (aiohttp.web) that checks each request and answers with the
text stored for the image it decodes; VllmOcrEngine against a stub `vllm` module. TransformersOcrEngine runs
a tiny random Qwen2.5-VL (benchmarks/vlm_model.py) on the CPU."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web

from fgrpo.rewards import build_reward
from fgrpo.rewards.ocr import OcrReward
from fgrpo.rewards.transport import RewardServiceError, decode_image
from fgrpo.rewards.vlm import DEFAULT_PROMPT, TransformersOcrEngine, VllmOcrEngine, VlmOcrEngine
from fgrpo.scripts import load_script

from .helpers import serve_in_thread

rng = np.random.default_rng(0)
IMAGES = rng.integers(0, 256, (5, 12, 10, 3), dtype=np.uint8)
TEXTS = ["STOP", "Sale", "hello world", "", "open"]  # what the fake VLM "reads" in each image
PROMPTS = ['"stop"', '"sale"', '"Hello World"', '"x"', '"closed"']
SCORES = [1, 1, 1, 0, 1 - 4 / 6]  # ocr_score of TEXTS against PROMPTS' targets


def fake_openai(
    log: dict, *, fail_first: int = 0, status: int = 500, reply=None, delay_s: float = 0.0, die_after: int = 0
):
    """A chat-completions endpoint that validates the request and transcribes by looking the image up.
    Its first `fail_first` requests get `status`, with Retry-After 1 ms so the client's retry is quick. With
    `die_after` N, every request after the N-th has its connection dropped unanswered, as a killed server's."""
    log.update(requests=0, in_flight=0, max_in_flight=0, auth=set())

    async def chat(request: web.Request) -> web.Response:
        log["requests"] += 1
        log["auth"].add(request.headers.get("Authorization"))
        if die_after and log["requests"] > die_after:
            assert request.transport is not None
            request.transport.abort()
            return web.Response()  # never sent: the connection is gone
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


def test_vlm_engine_server_killed_mid_batch_is_a_clear_error_within_its_retries():
    """The server dies after reading 2 of the 5 images: the client retries the dropped request max_retries times
    and stops with one error naming the server, in well under a timeout (no hang on a dead connection)."""
    import time

    log: dict = {}
    with serve_in_thread(fake_openai(log, die_after=2)) as url:
        engine = VlmOcrEngine(url, "test-vlm", max_concurrency=1, max_retries=2, timeout_s=30)
        start = time.monotonic()
        with pytest.raises(RewardServiceError, match=r"unreachable after 3 attempt\(s\)") as e:
            engine.recognize(IMAGES)
        assert time.monotonic() - start < 10
    assert "\n" not in str(e.value)
    # the third image's 3 attempts, each at most 2 requests (httpx resends once when a kept-alive connection drops
    # unanswered); the images after it are not tried (Executor.map cancels them on the error)
    assert 2 + 3 <= log["requests"] <= 2 + 2 * 3


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


# ------------------------------------------------------------------------------------------------
# TransformersOcrEngine on a tiny random Qwen2.5-VL (fp32 on the CPU)

# 56 x 84 px = 4 x 6 patches of 14 px = 2 x 3 merged 2x2 patches: 6 <|image_pad|> tokens per image.
VL_IMAGES = rng.integers(0, 256, (3, 56, 84, 3), dtype=np.uint8)
VL_PADS = 6
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def vlm_model():
    return load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "vlm_model.py")


@pytest.fixture(scope="module")
def tiny_vlm(vlm_model):
    return vlm_model.build_random_vlm("tiny", "cpu", dtype=torch.float32, seed=0)


def test_random_3b_vlm_has_qwen25_vl_3b_widths(vlm_model):
    """Built on the meta device (shapes only): the parameter counts of Qwen/Qwen2.5-VL-3B-Instruct's
    safetensors, 3,754,622,976 in all and 668,684,288 in the vision tower, with the LM head tied."""
    model, _ = vlm_model.build_random_vlm("3b", "meta")
    assert sum(p.numel() for p in model.parameters()) == 3_754_622_976
    assert sum(p.numel() for p in model.model.visual.parameters()) == 668_684_288
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.fixture(scope="module")
def tiny_texts(tiny_vlm):
    return TransformersOcrEngine(*tiny_vlm, max_tokens=MAX_TOKENS).recognize(VL_IMAGES)


def test_transformers_engine_sends_qwens_chat_with_one_pad_per_merged_patch(tiny_vlm):
    model, processor = tiny_vlm
    engine = TransformersOcrEngine(model, processor)
    inputs = processor(text=[engine.text], images=[VL_IMAGES[0]], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert processor.tokenizer.decode(inputs["input_ids"][0]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
        + "<|image_pad|>" * VL_PADS
        + f"<|vision_end|>{DEFAULT_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_transformers_engine_decodes_only_its_greedy_new_tokens(tiny_vlm, tiny_texts):
    """Reference: argmax of the last logits, one full forward per token (no KV cache, no generate), from the
    prompt until <|im_end|> or MAX_TOKENS; the engine's text is those tokens decoded, without the prompt."""
    model, processor = tiny_vlm
    engine = TransformersOcrEngine(model, processor)
    tok = processor.tokenizer
    assert len(tiny_texts) == len(VL_IMAGES) and all(isinstance(t, str) for t in tiny_texts)
    for image, text in zip(VL_IMAGES, tiny_texts):
        inputs = processor(text=[engine.text], images=[image], return_tensors="pt")
        ids = inputs["input_ids"]
        n_prompt = ids.shape[1]
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                logits = model(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    pixel_values=inputs["pixel_values"],
                    image_grid_thw=inputs["image_grid_thw"],
                ).logits
                ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
                if ids[0, -1] == model.config.text_config.eos_token_id:
                    break
        assert text == tok.decode(ids[0, n_prompt:], skip_special_tokens=True)
        assert text and DEFAULT_PROMPT in tok.decode(ids[0], skip_special_tokens=True)
        assert DEFAULT_PROMPT not in text


def test_transformers_engine_is_deterministic_and_batches_read_like_single_images(tiny_vlm, tiny_texts):
    model, processor = tiny_vlm
    sizes = []
    generate = model.generate

    def counting_generate(**kw):
        sizes.append(len(kw["input_ids"]))
        return generate(**kw)

    engine = TransformersOcrEngine(model, processor, batch_size=2, max_tokens=MAX_TOKENS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "generate", counting_generate)
        batched = engine.recognize(VL_IMAGES)
    assert sizes == [2, 1]
    assert batched == tiny_texts  # batch_size 32 (one call of 3), 2 (2 + 1) and 1 read the same
    single = TransformersOcrEngine(model, processor, batch_size=1, max_tokens=MAX_TOKENS)
    assert [single.recognize(im[None])[0] for im in VL_IMAGES] == tiny_texts
    assert engine.recognize(VL_IMAGES[:0]) == []


def test_transformers_engine_static_cache_reads_the_same_tokens(tiny_vlm, tiny_texts):
    """static_cache=True hands generate a preallocated KV cache (cache_implementation="static", what lets
    transformers compile the decoding step on a GPU) and reads the same greedy texts as the growing cache."""
    model, processor = tiny_vlm
    seen = []
    generate = model.generate

    def recording_generate(**kw):
        seen.append(kw.get("cache_implementation"))
        return generate(**kw)

    engine = TransformersOcrEngine(model, processor, max_tokens=MAX_TOKENS, static_cache=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "generate", recording_generate)
        assert engine.recognize(VL_IMAGES) == tiny_texts
        TransformersOcrEngine(model, processor, max_tokens=MAX_TOKENS).recognize(VL_IMAGES[:1])
    assert seen == ["static", None]


def test_transformers_engine_torchvision_backend_reads_as_pil_on_the_models_device(tiny_vlm, tiny_texts):
    """image_backend="torchvision": transformers' torchvision Qwen2-VL image processor with the PIL one's settings
    gets each batch as one uint8 [B, 3, H, W] tensor on the model's device, with device= set. VL_IMAGES need no
    resize (multiples of 28 px), so the pixels agree with PIL's to float rounding and the tokens are the same:
    the texts equal the PIL engine's. The chat is tokenized once per batch size and image size: a second call
    of the same sizes runs the image processor alone and hands generate the same tokens."""
    model, processor = tiny_vlm
    engine = TransformersOcrEngine(model, processor, max_tokens=MAX_TOKENS, image_backend="torchvision")
    image_processor = engine.processor.image_processor
    assert type(image_processor).__name__ == "Qwen2VLImageProcessor"
    assert image_processor.to_dict() == processor.image_processor.to_dict()
    pixels, tokenized, given = [], [], []
    call, image_call, generate = (
        type(engine.processor).__call__,
        type(image_processor).__call__,
        model.generate,
    )

    def recording_image_call(self, images, **kw):
        pixels.append((type(images), images.shape, images.dtype, images.device, kw.get("device")))
        return image_call(self, images, **kw)

    def recording_call(self, **kw):
        tokenized.append(len(kw["text"]))
        return call(self, **kw)

    def recording_generate(**kw):
        given.append({k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)})
        return generate(**kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(image_processor), "__call__", recording_image_call)
        mp.setattr(type(engine.processor), "__call__", recording_call)
        mp.setattr(model, "generate", recording_generate)
        assert engine.recognize(VL_IMAGES) == tiny_texts
        assert engine.recognize(VL_IMAGES) == tiny_texts
    assert tokenized == [3]  # the first call's; its image processor ran inside (a third call of it)
    assert pixels == [(torch.Tensor, (3, 3, 56, 84), torch.uint8, model.device, model.device)] * 3
    assert (
        given[0].keys()
        == given[1].keys()
        >= {"input_ids", "attention_mask", "pixel_values", "image_grid_thw"}
    )
    for k in given[0]:
        assert torch.equal(given[0][k], given[1][k]), k
    pil = processor(text=[engine.text] * 3, images=list(VL_IMAGES), return_tensors="pt")
    for k in ("input_ids", "attention_mask", "image_grid_thw"):
        assert torch.equal(given[0][k], pil[k]), k
    torch.testing.assert_close(given[0]["pixel_values"], pil["pixel_values"], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="image_backend must be one of"):
        TransformersOcrEngine(model, processor, image_backend="cv2")


def test_varlen_vision_attention_reads_as_sdpa_with_one_call_per_layer():
    """varlen_vision=True: each vision layer calls the attention once with its windows' offsets (cu_seqlens, from
    0 to every patch) instead of once per window, and the texts are the sdpa engine's (on the CPU the function
    runs SDPA per window, transformers' own loop; on a GPU torch's varlen kernel, tested there). The language
    model keeps sdpa. A model of its own: the setting stays on the model."""
    from transformers import AttentionInterface

    from fgrpo.rewards import vlm

    vlm_model = load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "vlm_model.py")
    model, processor = vlm_model.build_random_vlm("tiny", "cpu", dtype=torch.float32, seed=0)
    images = rng.integers(0, 256, (2, 112, 168, 3), dtype=np.uint8)  # 8 x 12 patches each: several windows
    sdpa = TransformersOcrEngine(model, processor, max_tokens=MAX_TOKENS).recognize(images)
    engine = TransformersOcrEngine(model, processor, max_tokens=MAX_TOKENS, varlen_vision=True)
    offsets = []

    def recording(*args, **kw):
        offsets.append(kw["cu_seq_lens_q"].tolist())
        return vlm.varlen_vision_attention(*args, **kw)

    AttentionInterface.register(vlm.VARLEN_VISION, recording)
    try:
        assert engine.recognize(images) == sdpa
    finally:
        AttentionInterface.register(vlm.VARLEN_VISION, vlm.varlen_vision_attention)
    assert len(offsets) == model.config.vision_config.depth
    # a windowed layer (windows of 16 patches here) and a full one (one per image)
    assert offsets == [list(range(0, 193, 16)), [0, 96, 192]]
    assert model.config.vision_config._attn_implementation == vlm.VARLEN_VISION
    assert model.config.text_config._attn_implementation == "sdpa"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch's varlen attention")
def test_varlen_vision_attention_on_a_gpu_is_sdpa_per_window():
    """torch's varlen kernel against one SDPA call per window, bf16 on a GPU: windows of 64, 64, 37 and 100
    tokens, 16 heads of 80 (Qwen2.5-VL's vision widths)."""
    import torch.nn.functional as F

    from fgrpo.rewards.vlm import varlen_vision_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, 16, 265, 80, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    cu = torch.tensor([0, 64, 128, 165, 265], device="cuda", dtype=torch.int32)
    out, _ = varlen_vision_attention(
        None,
        q,
        k,
        v,
        None,
        scaling=80**-0.5,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=100,
        max_length_k=100,
    )
    ref = torch.cat(
        [
            F.scaled_dot_product_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :])
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
        ],
        dim=2,
    ).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_transformers_reward_from_a_checkpoint_directory_offline(
    vlm_model, tiny_texts, tmp_path, monkeypatch
):
    """The spec's directory loads (config, weights, tokenizer, chat template, image processor) with every
    network connection refused, and reads as the in-memory model of the same seed."""
    path = vlm_model.write_random_vlm(tmp_path / "vlm", "tiny", seed=0)

    def no_network(*args, **kwargs):
        raise AssertionError("the transformers OCR engine tried to open a connection; it must load offline")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    spec = {"name": "ocr", "engine": "transformers", "model": str(path), "device": "cpu", "dtype": "float32"}
    reward = build_reward({**spec, "max_tokens": MAX_TOKENS})
    assert isinstance(reward, OcrReward) and isinstance(reward.engine, TransformersOcrEngine)
    assert reward.engine.recognize(VL_IMAGES) == tiny_texts
    out = reward(VL_IMAGES, ['"stop"', '"sale"', '"open"'])
    assert out.scores.shape == (3,) and ((out.scores >= 0) & (out.scores <= 1)).all()


def test_the_served_checkpoints_tokenizer_decodes_every_id_of_the_model(vlm_model):
    """vLLM's detokenizer fails on an id its tokenizer lacks, and the random 3B emits ids across its 151936: the
    written tokenizer gets a placeholder for each id past its own, and its own tokens keep their ids."""
    tokenizer = vlm_model.random_vlm_processor().tokenizer
    n, text = len(tokenizer), "<|im_start|>user output only the text<|im_end|>"
    ids = tokenizer(text)["input_ids"]
    padded = vlm_model.pad_vocabulary(tokenizer, n + 3)
    assert len(padded) == n + 3 and padded(text)["input_ids"] == ids
    assert padded.decode([n, n + 2]) == f"<|r{n}|><|r{n + 2}|>"


def test_transformers_engine_reads_the_legacy_chat_template_file_or_says_it_is_missing(
    vlm_model, tiny_texts, tmp_path
):
    """Older checkpoints keep the template in the processor's chat_template.json, not the tokenizer's files."""
    path = vlm_model.write_random_vlm(tmp_path / "vlm", "tiny", seed=0)
    jinja = path / "chat_template.jinja"
    (path / "chat_template.json").write_text(json.dumps({"chat_template": jinja.read_text()}))
    jinja.unlink()
    engine = TransformersOcrEngine(str(path), device="cpu", dtype="float32", max_tokens=MAX_TOKENS)
    assert engine.recognize(VL_IMAGES) == tiny_texts
    (path / "chat_template.json").unlink()
    with pytest.raises(ValueError, match="has no chat template"):
        TransformersOcrEngine(str(path), device="cpu", dtype="float32")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_new_tokens": 16}, "unexpected keyword argument 'max_new_tokens'"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"dtype": "bf16"}, "dtype must name a torch dtype"),
        ({}, "has no config.json"),
    ],
)
def test_transformers_spec_errors_are_one_line(options, match, tmp_path):
    spec = {"name": "ocr", "engine": "transformers", "model": str(tmp_path), "device": "cpu", **options}
    if options.get("dtype"):
        (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=match) as e:
        build_reward(spec)
    assert "\n" not in str(e.value)
