"""Reward latency: rapidocr OCR per image (single and batched), JPEG reward, and the per-image overhead of
the HTTP reward service on loopback (PNG and JPEG on the wire). Prints one table.

    uv run python benchmarks/rewards.py                 # 512², 8 images
    uv run python benchmarks/rewards.py --size 1024 --n 16 --threads 2

Images are 512² renderings of short text (DejaVu Sans) so OCR does its real work (detect + recognize); two
more rows read the same texts as one line filling 32x128 (the text renderer's images) with and without the
detector (`RapidOcrEngine(detect=False)`); with --rec-device, one more reads them with the recognizer as a torch
module on that device (`RapidOcrEngine(detect=False, device=...)`, every image in one batch) and counts the texts
that differ from onnxruntime's, on the clean lines and on the same lines under pixel noise.
HTTP overhead = (HttpReward time - local time of the same reward) / images, the service running
`jpeg_compressibility` in a separate process, so it includes encode, transfer, decode and JSON both ways.

With --models, only the model-based rewards are timed instead, each built with random weights at its real
checkpoint's size (fgrpo.rewards.random_clip; nothing is downloaded) on --model-device, one call scoring
--model-batch images of --size² (the whole batch, as a training step hands it over):

    uv run python benchmarks/rewards.py --models clip_score,pickscore,hps,aesthetic,imagereward   # one GPU
    uv run python benchmarks/rewards.py --models pickscore --model-dtype bfloat16
    uv run python benchmarks/rewards.py --models all --tiny --model-device cpu --size 64           # wiring check
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from fgrpo.fonts import dejavu_sans
from fgrpo.rewards import HttpReward, OcrReward, RapidOcrEngine, Reward, build_reward

FONT = dejavu_sans()
WORDS = ["HELLO WORLD", "FLOW GRPO", "OPEN 24H", "SALE", "QWEN IMAGE", "NO PARKING", "CAFE", "EXIT"]


def render(text: str, size: int) -> np.ndarray:
    img = Image.new("RGB", (size, size), (250, 245, 235))
    draw = ImageDraw.Draw(img)
    draw.text(
        (size // 10, size // 2 - size // 16),
        text,
        fill=(20, 20, 20),
        font=ImageFont.truetype(str(FONT), size // 9),
    )
    return np.asarray(img)


def render_line(text: str, height: int = 32, width: int = 128) -> np.ndarray:
    """One line of text filling a height x width canvas, as the bundled text renderer draws its words."""
    left, top, right, bottom = ImageFont.truetype(str(FONT), 100).getbbox(text)
    size = min(24, int(min((width - 8) * 100 / (right - left), (height - 6) * 100 / (bottom - top))))
    font = ImageFont.truetype(str(FONT), size)
    left, top, right, bottom = font.getbbox(text)
    img = Image.new("RGB", (width, height), (235, 235, 235))
    xy = ((width - right - left) // 2, (height - bottom - top) // 2)
    ImageDraw.Draw(img).text(xy, text, fill=(30, 30, 30), font=font)
    return np.asarray(img)


def best_of(fn, repeats: int) -> tuple[float, float]:
    """(wall s, CPU s of this process) of the fastest of `repeats` runs. CPU time is the steadier number on
    a shared machine: it does not grow when other processes take the cores."""
    best = (float("inf"), 0.0)
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        best = min(best, (time.perf_counter() - t0, time.process_time() - c0))
    return best


def start_service(spec: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fgrpo.rewards.serve", "--reward", spec, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):  # up to 30 s
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("reward service did not start")


MODEL_REWARDS = ["clip_score", "pickscore", "hps", "aesthetic", "imagereward"]


def random_model_reward(name: str, *, tiny: bool, device: str, dtype: str, batch: int) -> Reward:
    """The reward `name` on a model with random weights: its checkpoint's architecture and size (or tiny)."""
    import torch

    from fgrpo.rewards.aesthetic import AestheticHead, AestheticReward
    from fgrpo.rewards.clip import ClipEmbedder, ClipScore
    from fgrpo.rewards.hps import HpsReward
    from fgrpo.rewards.imagereward import ImageReward
    from fgrpo.rewards.pickscore import PickScore
    from fgrpo.rewards.random_clip import random_clip, random_imagereward, random_open_clip

    torch_dtype = getattr(torch, dtype)
    if name in ("clip_score", "pickscore", "aesthetic"):
        size = "tiny" if tiny else ("h14" if name == "pickscore" else "l14")
        model, processor = random_clip(size, device, dtype=torch_dtype)
        embedder = ClipEmbedder(model, processor, batch_size=batch)
        if name == "clip_score":
            return ClipScore(embedder)
        if name == "pickscore":
            return PickScore(embedder)
        embed_dim = model.config.projection_dim
        assert embed_dim is not None  # CLIPConfig always sets it
        return AestheticReward(embedder, AestheticHead(embed_dim))
    if name == "hps":
        return HpsReward(
            random_open_clip("tiny" if tiny else "h14", device).to(torch_dtype), batch_size=batch
        )
    if name == "imagereward":
        model, tokenizer = random_imagereward("tiny" if tiny else "large", device)
        return ImageReward(model.to(torch_dtype), tokenizer, batch_size=batch)
    raise ValueError(f"unknown model reward {name!r}; choose from {MODEL_REWARDS}")


def time_model_rewards(args: argparse.Namespace) -> None:
    """One row per model reward: ms per image and images/s of one call on --model-batch images."""
    import torch

    names = MODEL_REWARDS if args.models == "all" else args.models.split(",")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (args.model_batch, args.size, args.size, 3), dtype=np.uint8)
    # the recipes' prompts: a group of images per prompt, so the text side encodes batch / 4 prompts
    prompts = [
        f'a photo of a sign that says "{WORDS[(i // 4) % len(WORDS)]}"' for i in range(args.model_batch)
    ]
    rows = []
    for name in names:
        reward = random_model_reward(
            name, tiny=args.tiny, device=args.model_device, dtype=args.model_dtype, batch=args.model_batch
        )
        reward(images, prompts)  # warm-up: kernels, allocator, the processor's first call
        t, _ = best_of(
            lambda r=reward: r(images, prompts), args.repeats
        )  # scores come back to the CPU: synced
        note = f"{args.model_batch / t:.0f} images/s; batch {args.model_batch}, {args.model_dtype}"
        rows.append((name, t / args.model_batch * 1e3, note))
        del reward
        if args.model_device.startswith("cuda"):
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if args.model_device.startswith("cuda") else platform.machine()
    size = "tiny models" if args.tiny else "random weights at real size"
    print(f"# model rewards: {args.size}x{args.size}, {size}, {args.model_device} ({device})")
    print(f"{'what':<38} {'ms':>9}  note")
    for name, ms, note in rows:
        print(f"{name:<38} {ms:>9.2f}  {note}")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--n", type=int, default=8, help="images per batch")
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    p.add_argument("--threads", type=int, default=None, help="onnxruntime threads (default: all cores)")
    p.add_argument("--rec-device", default="", help="also time the recognizer as a torch module here (cuda)")
    p.add_argument(
        "--models",
        default="",
        help=f"time these model rewards instead (comma-separated, or all: {','.join(MODEL_REWARDS)})",
    )
    p.add_argument("--model-device", default="cuda", help="where the model rewards run")
    p.add_argument("--model-batch", type=int, default=32, help="images per model-reward call (the recipe's)")
    p.add_argument("--model-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--tiny", action="store_true", help="tiny random models (a CPU wiring check, not a timing)"
    )
    args = p.parse_args()
    if args.models:
        time_model_rewards(args)
        return

    texts = [WORDS[i % len(WORDS)] for i in range(args.n)]
    images = np.stack([render(t, args.size) for t in texts])
    prompts = [f'a sign that says "{t}"' for t in texts]
    rows: list[tuple[str, float, str]] = []

    ocr = OcrReward(RapidOcrEngine(num_threads=args.threads))
    ocr(images[:1], prompts[:1])  # load the models outside the timing
    t1, c1 = best_of(lambda: ocr(images[:1], prompts[:1]), args.repeats)
    rows.append(("OCR rapidocr, batch 1", t1 * 1e3, f"per image; {c1 * 1e3:.0f} ms CPU (all threads)"))
    outs = []
    tb, cb = best_of(lambda: outs.append(ocr(images, prompts)), max(1, args.repeats - 1))
    note = f"per image; {cb / args.n * 1e3:.0f} ms CPU; mean score {outs[-1].scores.mean():.3f}"
    rows.append((f"OCR rapidocr, batch {args.n}", tb / args.n * 1e3, note))

    # The text renderer's images (one line filling 32x128): the full pipeline against recognition alone.
    lines = np.stack([render_line(t) for t in texts])
    for detect in (True, False):
        line_ocr = OcrReward(RapidOcrEngine(num_threads=args.threads, detect=detect))
        line_out = line_ocr(lines, prompts)  # also loads the models outside the timing
        tl, cl = best_of(lambda r=line_ocr: r(lines, prompts), args.repeats)
        what = f"OCR 32x128 line, {'detect+recognize' if detect else 'recognize only'}"
        note = f"per image; {cl / args.n * 1e3:.0f} ms CPU; mean score {line_out.scores.mean():.3f}"
        rows.append((what, tl / args.n * 1e3, note))
    if args.rec_device:
        rng = np.random.default_rng(0)
        noisy = np.clip(lines.astype(np.int64) + rng.integers(-120, 120, lines.shape), 0, 255).astype(
            np.uint8
        )
        both = np.concatenate([lines, noisy])
        ref = RapidOcrEngine(num_threads=args.threads, detect=False).recognize(both)
        dev = RapidOcrEngine(detect=False, device=args.rec_device, batch_size=256)
        got = dev.recognize(both)  # loads and warms the module outside the timing
        td, cd = best_of(lambda: dev.recognize(lines), args.repeats)
        differ = sum(a != b for a, b in zip(ref, got))
        note = (
            f"per image; {cd / args.n * 1e3:.2f} ms CPU; texts unlike onnxruntime's: {differ} of {len(both)} "
            f"(half under pixel noise)"
        )
        rows.append((f"OCR 32x128 line, recognize, {args.rec_device}", td / args.n * 1e3, note))

    jpeg = build_reward("jpeg_compressibility")
    tj, _ = best_of(lambda: jpeg(images, prompts), args.repeats)
    rows.append((f"JPEG compressibility, batch {args.n}", tj / args.n * 1e3, "per image"))

    proc, url = start_service("jpeg_compressibility")
    try:
        for fmt in ("png", "jpeg"):
            client = HttpReward(url, image_format=fmt, batch_size=args.n)
            client(images, prompts)  # warm the server's first request
            th, _ = best_of(lambda c=client: c(images, prompts), args.repeats)
            rows.append(
                (
                    f"HTTP overhead, {fmt} on the wire",
                    (th - tj) / args.n * 1e3,
                    f"per image (total {th / args.n * 1e3:.1f} ms)",
                )
            )
    finally:
        proc.kill()
        proc.wait()

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    threads = args.threads or "all"
    print(
        f"# rewards: {args.size}x{args.size}, {os.cpu_count()} CPUs ({platform.machine()}), OCR threads {threads}, load {load}"
    )
    print(f"{'what':<38} {'ms':>9}  note")
    for name, ms, note in rows:
        print(f"{name:<38} {ms:>9.1f}  {note}")


if __name__ == "__main__":
    main()
