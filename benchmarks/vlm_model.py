"""A Qwen2.5-VL with random weights, offline: the real 3B's widths (the OCR reward's model at real size) or a
tiny one for CPU tests, with a small byte-level tokenizer holding Qwen's chat and vision tokens, Qwen's chat
template and Qwen2-VL's image processor. The reward engine reads it as it would the real checkpoint.

    python benchmarks/vlm_model.py                    # H200: 32 images of 512², the recipe's reward batch
    python benchmarks/vlm_model.py --tiny --images 4  # CPU wiring check
    python benchmarks/vlm_model.py --caches static --image-backends pil,torchvision --batch-size 8

    model, processor = build_random_vlm("3b", device="cuda")          # in memory, bf16
    engine = TransformersOcrEngine(model, processor, batch_size=32, max_tokens=16)
    write_random_vlm("/tmp/vlm", "tiny")   # a checkpoint directory: {"engine": "transformers", "model": dir}

The random model reads nothing, so its text is noise and usually runs to max_tokens (a trained one stops at
<|im_end|> after a short answer): timings are an upper bound on decoding. Its tokenizer knows a few hundred
tokens; ids above those (most of the 3B's 151936) decode to nothing. Real Qwen2.5-VL ids of the special
tokens differ from the tiny tokenizer's; the config carries the tokenizer's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from fgrpo.models.qwen_image_edit import EDIT_PROMPT_DROP, EDIT_PROMPT_TEMPLATE
from fgrpo.models.qwen_vl import vl_processor
from fgrpo.models.tiny import VISION_TOKENS, tiny_qwen_tokenizer
from fgrpo.rewards.vlm import IMAGE_BACKENDS, TransformersOcrEngine

# Qwen/Qwen2.5-VL-3B-Instruct's config.json: the language model (36 layers of 2048, GQA 16/2 heads, MRoPE
# sections 16/24/24 of the 64 rotary pairs of a 128-wide head, tied embeddings) and its vision tower (32 blocks
# of 1280, windowed attention of 112 px except the full-attention blocks, merger to 2048).
QWEN25_VL_3B = {
    "text": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=128000,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    ),
    "vision": dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=2048,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        tokens_per_second=2,
        hidden_act="silu",
    ),
}
# The same structure (windowed and full-attention vision blocks, GQA, MRoPE) at a CPU test's size; the
# vocabulary is the tokenizer's, so every generated id decodes to text.
TINY = {
    "text": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=None,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
    ),
    "vision": dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        window_size=56,
        fullatt_block_indexes=[1],
    ),
}
SIZES = {"3b": QWEN25_VL_3B, "tiny": TINY}
# Qwen2.5-VL's preprocessor_config.json pixel bounds (the image is resized to multiples of 28 inside them).
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16384
# Qwen2.5-VL's chat layout: a default system turn, then each turn as <|im_start|>role\n...<|im_end|>\n, an
# image as <|vision_start|><|image_pad|><|vision_end|> (the processor repeats the pad once per merged patch).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message.role != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.content is string -%}{{- message.content -}}{%- else -%}"
    "{%- for part in message.content -%}"
    "{%- if part.type in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def random_vlm_processor() -> Any:
    """Qwen2-VL's images-only processor over the tiny Qwen tokenizer (chat and vision tokens) with the chat
    template, and the image processor at Qwen2.5-VL's pixel bounds."""
    # The edit template holds an image placeholder, so the tokenizer gets the vision tokens besides the chat ones.
    tokenizer = tiny_qwen_tokenizer(EDIT_PROMPT_TEMPLATE, EDIT_PROMPT_DROP)
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return vl_processor(image_processor, tokenizer)


def vlm_config(size: str, tokenizer) -> Qwen2_5_VLConfig:
    """Qwen2_5_VLConfig of `size` ("3b" or "tiny") whose special-token ids are `tokenizer`'s."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    ids = tokenizer.get_vocab()
    names = ("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id")
    text = dict(SIZES[size]["text"])
    text["vocab_size"] = text["vocab_size"] or len(tokenizer)
    text.update(bos_token_id=None, eos_token_id=ids["<|im_end|>"], pad_token_id=tokenizer.pad_token_id)
    vision = dict(SIZES[size]["vision"])
    # pyright matches a ** dict against every keyword; these are the int token ids
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=size == "3b",
        **{n: ids[t] for n, t in zip(names, VISION_TOKENS)},  # pyright: ignore[reportArgumentType]
    )


def build_random_vlm(
    size: str = "3b",
    device: torch.device | str = "cuda",
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> tuple[Qwen2_5_VLForConditionalGeneration, Any]:
    """(model, processor): random weights (transformers' init, seeded) built directly on `device` in `dtype`.

    On the meta device it costs no memory (shapes only)."""
    processor = random_vlm_processor()
    config = vlm_config(size, processor.tokenizer)
    cuda = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype)
    return model.eval(), processor


def write_random_vlm(
    path: str | Path, size: str = "tiny", *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> Path:
    """Write a checkpoint directory (config.json, model.safetensors, tokenizer, chat template,
    preprocessor_config.json) that `fgrpo.rewards.vlm.load_qwen_vl` and `vllm serve` load offline ("3b": 15 GB
    in fp32, 7.5 GB in bf16). Where the model's vocabulary is larger than the tokenizer's (the 3B's 151936), the
    written tokenizer gets one placeholder token <|r{id}|> per missing id, so every id the random model emits
    decodes to text: vLLM's detokenizer fails on ids its tokenizer lacks."""
    path = Path(path)
    model, processor = build_random_vlm(size, "cpu", dtype=dtype, seed=seed)
    model.save_pretrained(path)
    tokenizer = pad_vocabulary(processor.tokenizer, model.config.get_text_config().vocab_size)
    tokenizer.save_pretrained(path)
    processor.image_processor.save_pretrained(path)
    return path


def pad_vocabulary(tokenizer, vocab: int):
    """`tokenizer` with one placeholder token <|r{id}|> for each id from its length up to `vocab`, the model's
    vocabulary: those ids then decode to text, and the tokens it had keep their ids."""
    tokenizer.add_tokens([f"<|r{i}|>" for i in range(len(tokenizer), vocab)])
    return tokenizer


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(
    path: str | Path, port: int, gpu_fraction: float, max_model_len: int, eager: bool
) -> list[str]:
    """`vllm serve` of checkpoint `path` on 127.0.0.1:port as this Python's module, bf16."""
    # One image a request and no video: vLLM sizes its memory profile by the largest input a prompt may hold,
    # and the processor's own bound (16384 visual tokens) would not fit max_model_len; 1 MP is 1337 tokens.
    mm = ["--limit-mm-per-prompt", '{"image": 1, "video": 0}']
    mm += ["--mm-processor-kwargs", '{"max_pixels": 1048576}']
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--host", "127.0.0.1",
        "--port", str(port), "--dtype", "bfloat16", "--gpu-memory-utilization", str(gpu_fraction),
        "--max-model-len", str(max_model_len), *mm, *(["--enforce-eager"] if eager else []),
    ]  # fmt: skip


def serve_env() -> dict[str, str]:
    """The server's environment: this one, with vLLM's FlashInfer sampler off where flashinfer is not installed
    (vLLM 0.30 imports it for top-k/top-p sampling on CUDA and fails to start without it; the reward decodes
    greedily, so the sampler is not on its path). A value the caller set is kept."""
    env = dict(os.environ)
    if importlib.util.find_spec("flashinfer") is None:
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


# A console line that is an exception's last line: "SomeError: message", after vLLM's "(EngineCore pid=N)" and its
# "ERROR date [file:line]" prefixes.
_EXCEPTION_LINE = re.compile(
    r"^(?:\(\w+ pid=\d+\)\s+)?(?:ERROR [\d-]+ [\d:]+ \[[^\]]+\]\s+)?(\w+(?:Error|Exception): .*)$"
)


def console_errors(text: str) -> list[str]:
    """The exceptions a server's console ends its tracebacks with, each once, in the order they first appear: the
    root cause comes before the error it caused (vLLM's API server reports an engine that failed to start, with
    the engine's own error some 40 lines above the console's end)."""
    seen: dict[str, None] = {}
    for line in text.splitlines():
        m = _EXCEPTION_LINE.match(line.strip())
        if m:
            seen.setdefault(m.group(1), None)
    return list(seen)


# The server runs under this supervisor. It leads the server's own session, so that kill() reaches every process of
# it, and it dies with the process that started it, taking the whole group along (vLLM's engine processes included):
# a server in a session of its own would otherwise outlive a trainer stopped by an error or a timeout's kill and
# keep its share of the GPU. Linux's PR_SET_PDEATHSIG sends the supervisor SIGTERM when the starting thread ends;
# argv[1], the starter's pid, catches a starter that died before prctl took effect.
_LEASH = """
import ctypes, os, signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
if sys.platform == "linux":
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    os.killpg(0, signal.SIGKILL)
sys.exit(subprocess.call(sys.argv[2:]))
"""


class VllmServer:
    """`vllm serve` of a checkpoint directory in a process group of its own on 127.0.0.1, its console in `log`;
    the model is served under its path, the name VlmOcrEngine's `model` sends. On Linux the group dies with the
    thread that built this object (the process exiting, raising or killed): build it on the main thread.

    gpu_fraction: vLLM's --gpu-memory-utilization, the share of the GPU's memory it takes for weights, activations
    and KV cache (beside a trainer, start it before the trainer allocates). command: an argv to run instead of
    `python -m vllm.entrypoints.openai.api_server ...`, given `--port PORT` at its end (tests start a fake
    server)."""

    def __init__(
        self,
        path: str | Path,
        log: str | Path,
        *,
        gpu_fraction: float = 0.1,
        max_model_len: int = 4096,
        eager: bool = False,
        command: list[str] | None = None,
    ):
        self.path = Path(path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        argv = command or serve_argv(path, self.port, gpu_fraction, max_model_len, eager)
        with open(self.log, "w") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _LEASH,
                    str(os.getpid()),
                    *argv,
                    *(["--port", str(self.port)] if command else []),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # kill() takes its workers (vLLM's engine core) with it
                env=serve_env(),
            )

    def wait(self, timeout_s: float = 900.0) -> float:
        """Block until GET /v1/models answers 200; the seconds it took. RuntimeError (with the log's tail) if the
        server exits or does not answer within timeout_s."""
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                errors = " | ".join(console_errors(self.log.read_text(errors="replace"))) or "none named"
                raise RuntimeError(
                    f"vllm serve exited ({self.proc.returncode}) before serving; the errors in its console: "
                    f"{errors}; its last lines:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > timeout_s:
                self.kill()
                raise RuntimeError(f"vllm serve did not answer within {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(1.0)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL to the whole process group, as a crashed machine would leave it; then reap it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random model on CPU in fp32 (wiring check)")
    ap.add_argument("--images", type=int, default=32, help="images per reward call (the recipe's step batch)")
    ap.add_argument("--size", type=int, default=512, help="image side in pixels")
    ap.add_argument("--batch-size", type=int, default=32, help="images per generate call")
    ap.add_argument("--max-tokens", type=int, default=16, help="generated tokens per image at most")
    ap.add_argument("--iters", type=int, default=3, help="timed calls after one warm-up")
    ap.add_argument(
        "--caches",
        default="dynamic",
        help="KV caches to time in turn, comma-separated: dynamic (generate's default), static (preallocated; its "
        "decoding step is compiled on a GPU); the texts of each are compared with the first's",
    )
    ap.add_argument(
        "--image-backends",
        default="pil",
        help="the image processor's backends to time with each cache, comma-separated: pil (on the CPU), "
        "torchvision (on the model's device); TransformersOcrEngine's image_backend",
    )
    ap.add_argument(
        "--varlen-vision",
        default="off",
        help="the vision tower's windowed attention, comma-separated settings to time with each cache: off (one SDPA "
        "call per window, transformers' sdpa), on (one variable-length call per layer); TransformersOcrEngine's "
        "varlen_vision",
    )
    args = ap.parse_args()
    if args.iters < 1:
        ap.error("--iters must be >= 1")
    caches = args.caches.split(",")
    if not caches or any(c not in ("dynamic", "static") for c in caches):
        ap.error(f"--caches takes dynamic and/or static, comma-separated; got {args.caches!r}")
    varlens = args.varlen_vision.split(",")
    if varlens not in (["off"], ["on"], ["off", "on"]):
        ap.error(
            f"--varlen-vision takes off, on or off,on (it stays set on the model); got {args.varlen_vision!r}"
        )
    backends = args.image_backends.split(",")
    if not backends or any(b not in IMAGE_BACKENDS for b in backends):
        ap.error(
            f"--image-backends takes {' and/or '.join(IMAGE_BACKENDS)}, comma-separated; got {args.image_backends!r}"
        )
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    model, processor = build_random_vlm("tiny" if args.tiny else "3b", device, dtype=dtype, seed=0)
    sync()
    build_s = time.perf_counter() - t0
    images = np.random.default_rng(0).integers(0, 256, (args.images, args.size, args.size, 3), dtype=np.uint8)
    rows, first_texts = [], None
    # varlen last: it stays set on the model
    for varlen, cache, backend in ((v, c, b) for v in varlens for c in caches for b in backends):
        engine = TransformersOcrEngine(
            model,
            processor,
            batch_size=args.batch_size,
            max_tokens=args.max_tokens,
            static_cache=cache == "static",
            image_backend=backend,
            varlen_vision=varlen == "on",
        )
        sync()
        t0 = time.perf_counter()
        texts = engine.recognize(images)  # warm-up: kernels, allocator, the static cache's compile
        sync()
        warm_s = time.perf_counter() - t0
        call_s = []
        for _ in range(args.iters):
            sync()
            t0 = time.perf_counter()
            engine.recognize(images)
            sync()
            call_s.append(time.perf_counter() - t0)
        first_texts = texts if first_texts is None else first_texts
        name = cache + (f" cache, {backend} images" if len(backends) > 1 else " cache")
        name += ", varlen vision" if varlen == "on" else ""
        rows.append((name, warm_s, min(call_s), texts == first_texts))
    text = TransformersOcrEngine(model, processor).text  # the prompt every call sends

    def preprocess(backend: str) -> tuple[Any, float]:
        """The processor alone on the images (their text and pixels): its inputs and seconds."""
        sync()
        t0 = time.perf_counter()
        if backend == "torchvision":
            x = torch.from_numpy(images).to(device).permute(0, 3, 1, 2)
            proc = TransformersOcrEngine(model, processor, image_backend=backend).processor
            inputs = proc(text=[text] * len(images), images=x, return_tensors="pt", device=device)
        else:
            inputs = processor(text=[text] * len(images), images=list(images), return_tensors="pt")
        sync()
        return inputs, time.perf_counter() - t0

    prep = []
    for backend in backends:
        preprocess(backend)  # the first call warms the resize kernels
        prep.append((backend, preprocess(backend)[1]))
    tokens = preprocess("pil")[0]["input_ids"].shape[1]
    params = sum(p.numel() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    name = "tiny" if args.tiny else "3B"
    print(f"Qwen2.5-VL {name}, random weights ({params:,} params, {dtype}), {device}")
    print(f"{args.images} images of {args.size}², batch {args.batch_size}, max_tokens {args.max_tokens}")
    print("| what | value |\n| --- | --- |")
    print(f"| build (s) | {build_s:.2f} |")
    print(f"| prompt tokens per image (image pads included) | {tokens} |")
    for name, warm_s, best_s, same in rows:
        print(f"| {name}: first call, warm-up included (s) | {warm_s:.2f} |")
        print(f"| {name}: reward call (s, best of {args.iters}) | {best_s:.3f} |")
        print(f"| {name}: per image (ms) | {1e3 * best_s / args.images:.1f} |")
        print(f"| {name}: texts equal to the first row's ({rows[0][0]}) | {same} |")
    for backend, prep_s in prep:
        where = "on the model's device" if backend == "torchvision" else "on the CPU"
        print(f"| processor alone, {backend} images {where} (s) | {prep_s:.3f} |")
    print(f"| peak GPU memory (GiB) | {peak:.1f} |")


if __name__ == "__main__":
    main()
