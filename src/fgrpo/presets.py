"""Presets shared by the experiment files: an experiment's configuration trained by another algorithm, with that
algorithm's reference values (`with_algo`). Each experiment file keeps its own recipe; what it shares lives here, so
no experiment file imports another."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from fgrpo.config import TrainConfig

C = TypeVar("C", bound=TrainConfig)


def with_algo(base: C, name: str, *, size: str) -> C:
    """`base` (an experiment's preset) trained by another algorithm (fgrpo/algorithms.py), with that algorithm's
    reference values.

    The data, model, batch (prompts x group size), optimizer steps per step, lr and schedule stay the base
    preset's, so on one budget the algorithms differ in their update rule alone. Recipe values come from the
    reference code: Flow-DPPO and DiffusionNFT from verl-omni's / NVlabs' Qwen-Image and SD3 OCR scripts, AWM
    from its SD3 OCR recipe, MixGRPO from its FLUX scripts (there is no Qwen-Image one).
    `size`: "recipe" (real model) or "tiny" (the text renderer, CPU or GPU); `name`: dppo, mixgrpo, mixgrpo-flash,
    nft or awm.
    """
    tiny_size = size == "tiny"
    g, s, a = base.grpo, base.sampling, base.algo
    if name == "dppo":  # no ratio clip: the KL mask is the trust region (tau 1e-5, both references)
        return dataclasses.replace(base, algo=dataclasses.replace(a, name="dppo", dppo_tau=1e-5))
    if name in ("mixgrpo", "mixgrpo-flash"):
        # The shared window starts at the first step, moves one step every window_iters training steps and
        # restarts after the last (algo.window_roll_back); tiny runs are short, so the window moves sooner.
        iters = max(1, base.num_steps // 8) if tiny_size else 25
        out = dataclasses.replace(
            base, algo=dataclasses.replace(a, name="mixgrpo", window_iters=iters, window_stride=1)
        )
        if name == "mixgrpo-flash":
            # MixGRPO-Flash (scripts/finetune/finetune_flux_grpo_MixGRPO.sh with dpm_algorithm_type dpmsolver++,
            # dpm_apply_strategy post): after the window, DPM-Solver++(2M) on 40 % of the remaining steps.
            out = dataclasses.replace(
                out, sampling=dataclasses.replace(s, ode_tail="dpmpp_2m", tail_compress=0.4)
            )
        return out
    # NFT and AWM sample without CFG (both references) with fgrpo's Euler ODE (NFT's reference: a 2nd-order ODE
    # solver; AWM's: an SA-solver, stochastic on t in [0.3, 0.9]; algorithms.py) and train at K forward-process points
    # a sample. The recipes train 9 of 10 grid steps (NFT) or 6 (AWM); the tiny presets train 2 points a sample,
    # the compute of the base preset's 2-step SDE window, and leave out the reference-KL forward, as the base does
    # (AWM keeps its EMA forward: that KL is what holds it).
    sampling = dataclasses.replace(s, guidance_scale=1.0)
    if name == "nft":
        algo = dataclasses.replace(
            a,
            name="nft",
            nft_beta=0.1,
            train_steps=2 if tiny_size else 9,
            sample_from_ema=True,
            ema_rate=0.0075,
            ema_max_decay=0.999,
            ema_delay=75,
        )
        grpo = dataclasses.replace(g, kl_coef=0.0 if tiny_size else 1e-4)
    elif name == "awm":
        # The first grid step (sigma = 1: x_t is pure noise) is left out, as in the reference. The KL to the
        # policy's EMA (weight 1, decay ramping to 0.3) damps each step, on in every preset; the KL to the frozen
        # model anchors (the reference always runs with it; the tiny presets without, as the other algorithms').
        algo = dataclasses.replace(
            a,
            name="awm",
            awm_p=0.25,
            train_steps=2 if tiny_size else 6,
            train_steps_lo=1,
            ema_kl_coef=1.0,
            kl_ema_rate=0.001,
            kl_ema_max_decay=0.3,
        )
        grpo = dataclasses.replace(g, clip_range=1.0, kl_coef=0.0 if tiny_size else 3e-3)
    else:
        raise ValueError(f"unknown algorithm {name!r}")
    return dataclasses.replace(base, sampling=sampling, grpo=grpo, algo=algo)
