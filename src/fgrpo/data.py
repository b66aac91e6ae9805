"""Prompt files and the deterministic per-step prompt order."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def load_prompts(path: str | Path, *, require_quoted: bool = False, field: str = "data.train_prompts") -> list[str]:
    """Prompts from a .txt (one per line) or .jsonl (a 'prompt' key per line) file, or the bundled
    text-renderer words ('textbed:train' / 'textbed:heldout', each word as '"WORD"').

    require_quoted: every prompt must contain a "double-quoted" target (the OCR task's contract).
    """
    if str(path).startswith("textbed:"):  # the bundled text renderer's word lists
        from fgrpo.models.textbed import prompt_for, read_words

        split = str(path).removeprefix("textbed:")
        if split not in ("train", "heldout"):
            raise ValueError(f"{field}: '{path}' must be 'textbed:train' or 'textbed:heldout'")
        return [prompt_for(w) for w in read_words(split)]
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{field}: no prompt file at '{p}'; pass --{field.replace('_', '-')} PATH")
    if p.suffix == ".jsonl":
        prompts = [json.loads(line)["prompt"] for line in p.read_text().splitlines() if line.strip()]
    else:
        prompts = [line.strip() for line in p.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{field}: '{p}' holds no prompts; give a file with one prompt per line")
    if require_quoted:
        for n, prompt in enumerate(prompts, 1):
            if prompt.count('"') < 2:
                raise ValueError(
                    f"{field}: line {n} of '{p}' has no double-quoted target text: {prompt!r}; "
                    'OCR prompts must quote the text to render, e.g. A sign that says "OPEN"'
                )
    return prompts


def step_prompt_indices(num_prompts: int, step: int, per_step: int, seed: int) -> torch.Tensor:
    """Indices of the prompts used at `step`: consecutive slices of per-epoch random permutations.

    A pure function of (step, seed), so a resumed run sees exactly the prompts it would have seen, and
    every rank computes the same list without communicating.
    """
    start = step * per_step
    out = []
    while len(out) < per_step:
        epoch, offset = divmod(start + len(out), num_prompts)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(num_prompts, generator=g)
        take = min(per_step - len(out), num_prompts - offset)
        out.extend(perm[offset : offset + take].tolist())
    return torch.tensor(out, dtype=torch.long)
