"""Prompt files and the deterministic per-step prompt order."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fgrpo.errors import ConfigError, MissingFileError
from fgrpo.models.base import ImagePrompt
from fgrpo.models.textbed import prompt_for, read_words
from fgrpo.rewards.ocr import extract_target
from fgrpo.rollout.seeds import PROMPT_ORDER, stream_generator


def load_prompts(
    path: str | Path, *, require_quoted: bool = False, field: str = "data.train_prompts"
) -> list[str]:
    """Prompts from a .txt (one per line) or .jsonl (a 'prompt' key per line) file, or the bundled
    text-renderer words ('textbed:train' / 'textbed:heldout', each word as '"WORD"').

    A .jsonl row may name a condition image, {"prompt": ..., "image": "path.png"} (relative to the file's folder
    or absolute): its prompt is then an `ImagePrompt` whose `image` is that file's path.

    require_quoted: every prompt must quote a non-blank target (the OCR reward's `extract_target`).
    Raises ConfigError (a ValueError) naming `field`, the file and the line for a file that is not UTF-8, a .jsonl
    line that is not an object with a non-empty string 'prompt', an 'image' that is not a file, or (require_quoted)
    a prompt without a target; MissingFileError (a FileNotFoundError) for a file that is not there.
    """
    if str(path).startswith("textbed:"):  # the bundled text renderer's word lists
        split = str(path).removeprefix("textbed:")
        if split not in ("train", "heldout"):
            raise ConfigError(f"{field}: '{path}' must be 'textbed:train' or 'textbed:heldout'")
        return [prompt_for(w) for w in read_words(split)]
    p = Path(path)
    if not p.is_file():
        raise MissingFileError(f"{field}: no prompt file at '{p}'; pass --{field.replace('_', '-')} PATH")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{field}: '{p}' is not UTF-8 text (byte {e.start}, line {line}: {e.reason}); save it as UTF-8"
        ) from None
    text = text.removeprefix("\ufeff")  # a byte-order mark is not part of the first prompt
    numbered: list[tuple[int, str]] = []  # (line number in the file, prompt)
    # split("\n"), not splitlines(): the latter also splits at \x0b, \x1c, U+2028..., which may sit inside
    # a prompt, and would shift every later line number.
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            numbered.append((n, _jsonl_prompt(line, f"{field}: line {n} of '{p}'", p.parent)))
        else:
            numbered.append((n, line.strip()))
    if not numbered:
        raise ConfigError(f"{field}: '{p}' holds no prompts; give a file with one prompt per line")
    if require_quoted:
        for n, prompt in numbered:
            try:
                extract_target(prompt)
            except ValueError as e:
                raise ConfigError(
                    f"{field}: line {n} of '{p}' has no double-quoted target text: {e}"
                ) from None
    return [prompt for _, prompt in numbered]


def _jsonl_prompt(line: str, where: str, folder: Path) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f'{where} is not JSON ({e.msg} at column {e.colno}); write one object per line: {{"prompt": "..."}}'
        ) from None
    if not isinstance(row, dict) or "prompt" not in row:
        raise ConfigError(
            f"{where} is not a JSON object with a 'prompt' key: {line.strip()[:200]}; "
            'write one object per line: {"prompt": "..."}'
        )
    prompt = row["prompt"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
    if "image" not in row:
        return prompt
    image = row["image"]
    if not isinstance(image, str) or not (folder / image).is_file():
        raise ConfigError(
            f"{where}: 'image' {image!r} is not a file; give the condition image's path, relative to the file's "
            "folder or absolute"
        )
    return ImagePrompt(prompt, folder / image)


def step_prompt_indices(num_prompts: int, step: int, per_step: int, seed: int) -> torch.Tensor:
    """Indices of the prompts used at `step`: consecutive slices of per-epoch random permutations, epoch e
    drawn from rollout.seeds.stream_generator(seed, e, PROMPT_ORDER).

    A pure function of (step, seed), so a resumed run sees exactly the prompts it would have seen, and
    every rank computes the same list without communicating.
    """
    start = step * per_step
    out = []
    while len(out) < per_step:
        epoch, offset = divmod(start + len(out), num_prompts)
        perm = torch.randperm(num_prompts, generator=stream_generator(seed, epoch, PROMPT_ORDER))
        take = min(per_step - len(out), num_prompts - offset)
        out.extend(perm[offset : offset + take].tolist())
    return torch.tensor(out, dtype=torch.long)
