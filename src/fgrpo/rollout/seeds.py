"""Per-sample seeds and generators: a sample's randomness is a function of its seed alone.

The trainer derives one seed per sample from (run seed, step, global sample index) - or any other tuple
of ints - and the engine turns it into one CPU torch.Generator that draws, in this fixed order, the
sample's SDE window, its initial noise, and the noise of each of its stochastic steps. Nothing depends on
which other samples share the batch or micro-batch, on the device, or on the number of ranks.
"""

from __future__ import annotations

import hashlib
import struct

import torch

SEED_BITS = 63  # torch.Generator.manual_seed takes any int; 63 bits keep seeds valid int64 tensor entries

# The last key of every stream that is not a per-sample stream, so no two uses of sample_seed can meet:
# per-sample seeds are (run seed, step, sample index), 3 keys; these add a negative fourth key.
GROUP_INIT_NOISE = -1  # (run seed, step, group index, -1): the initial noise a GRPO group shares
MINIBATCH_ORDER = -2  # (run seed, step, 0, -2): the shuffling of a step's samples into mini-batches
PROMPT_ORDER = -3  # (run seed, epoch, 0, -3): the permutation of the prompts in an epoch
VALIDATION = -4  # (0, image, prompt index, -4): the validation seeds, the same for every run and step
TRAIN_POINTS = -5  # (sample seed, -5): a sample's forward-process training points (NFT, AWM)


def sample_seed(*keys: int) -> int:
    """A well-mixed seed in [0, 2^63) from a tuple of ints, e.g. sample_seed(run_seed, step, sample_index).

    BLAKE2b of the ints' 64-bit encodings: stable across processes and Python versions (unlike hash()),
    and neighbouring keys give unrelated seeds (unlike run_seed + index, whose streams overlap across steps).
    """
    if not keys:
        raise ValueError("sample_seed needs at least one int key")
    data = b"".join(struct.pack("<q", int(k)) if -(2**63) <= int(k) < 2**63 else _too_big(k) for k in keys)
    digest = hashlib.blake2b(data, digest_size=8, person=b"fgrpo-seed").digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def _too_big(k: int) -> bytes:
    raise ValueError(f"seed key {k} does not fit in a signed 64-bit integer")


def sample_generator(seed: int) -> torch.Generator:
    """The CPU generator all of one sample's random draws come from."""
    if not 0 <= int(seed) < 2**SEED_BITS:
        raise ValueError(f"seed {seed} must be in [0, 2^{SEED_BITS}); derive seeds with sample_seed(...)")
    return torch.Generator(device="cpu").manual_seed(int(seed))


def sample_seeds(seed: int, step: int, sample_ids: torch.Tensor) -> list[int]:
    """Per-sample seeds, a pure function of (run seed, step, global sample index)."""
    return [sample_seed(seed, step, int(i)) for i in sample_ids]


def group_init_seeds(seed: int, step: int, sample_ids: torch.Tensor, group_size: int) -> list[int]:
    """One initial-noise seed per GRPO group (samples g*G .. g*G+G-1 share it), a pure function of
    (run seed, step, group index)."""
    return [sample_seed(seed, step, int(i) // group_size, GROUP_INIT_NOISE) for i in sample_ids]


def validation_seeds(prompt_ids: torch.Tensor, image: int = 0) -> list[int]:
    """Seeds of the validation samples: fixed per prompt index, independent of the run's seed and step, so every
    validation of every run scores the same initial noises. `image` > 0: the seeds of a prompt's further images
    (fgrpo.evaluate samples several a prompt); image 0 is the one every validation draws."""
    return [sample_seed(0, image, int(i), VALIDATION) for i in prompt_ids]


def stream_generator(seed: int, step: int, stream: int) -> torch.Generator:
    """A CPU generator for one non-sample stream of a step (e.g. MINIBATCH_ORDER, PROMPT_ORDER)."""
    return sample_generator(sample_seed(seed, step, 0, stream))
