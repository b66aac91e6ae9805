"""Does a forward-process loss (AWM, DiffusionNFT) pull the policy towards its own samples or push it away, net?

Both losses move each sample's velocity along its flow-matching residual v - u (u = noise - x0, the
forward-process target), towards u for a well-rewarded sample and away for a badly rewarded one. With one weight
for every sample the pulls and pushes of a group cancel (the group advantages sum to 0). AWM's log-weight
(p < 1) and DiffusionNFT's adaptive weight divide by a power of the sample's own error (AWM: m^(p-1),
m = mean (v - u)^2; NFT: 1 / mean|x0_hat - x0|), so if the group's better-read samples have larger errors, the
worse ones weigh more and the group pushes away from its own samples on net: an update the reward does not ask
for, which raises the flow-matching error on the policy's own samples step after step.

For W held-out words x G ODE samples of the bundled renderer (the `tiny-gpu` preset's validation sampling, no
CFG), the OCR reward and the group advantages, at each grid step k (R fresh noises per sample): the gradient of
the core loss (core.awm, core.nft, at theta = old) with respect to each sample's velocity, projected on its
residual, c_b = <dL/dv_b, v_b - u_b> / |v_b - u_b|^2 (c_b > 0: descent moves v_b towards u_b), and per group
sum_b c_b / sum_b |c_b| (0: pulls and pushes cancel; < 0: a net push away from the group's own samples).

CPU:  uv run python benchmarks/forward_process_bias.py                  (12 words x 16, ~3 min)
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from _textbed import load_renderer, preset_rollout

from fgrpo.core import awm, nft, sde
from fgrpo.core.grpo import group_advantages
from fgrpo.data import load_prompts
from fgrpo.rewards import build_reward
from fgrpo.rollout.engine import DiffusersEngine, validation_sampling


def net_share(c: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] per-sample coefficients -> [B / G] per group sum(c) / sum(|c|) (in [-1, 1]; 0 for an all-zero group)."""
    g = c.reshape(-1, group_size)
    return g.sum(1) / g.abs().sum(1).clamp_min(1e-30)


def along_residual(grad: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """[B, ...] x2 -> [B]: <grad_b, residual_b> / |residual_b|^2."""
    dims = tuple(range(1, grad.ndim))
    return (grad * residual).sum(dims) / (residual**2).sum(dims)


def coefficients(
    loss: str, v: torch.Tensor, u: torch.Tensor, x_t, x0, t, adv: torch.Tensor, *, p: float = 0.25
) -> torch.Tensor:
    """[B] c_b of one loss at theta = old (the first update of a step): "awm-p<P>", "nft-adaptive", "nft-uniform"."""
    v = v.detach().clone().requires_grad_(True)
    if loss == "awm":
        lw = awm.awm_log_weight(v, x0, x0 + u, t, p=p)  # noise = u + x0
        value, _ = awm.awm_loss(lw, lw.detach(), adv)
    else:
        r = nft.optimality_prob(adv)
        value, _ = nft.nft_loss(v, v.detach(), x_t, x0, t, r, beta=1.0, weighting=loss.split("-")[1])
    (grad,) = torch.autograd.grad(value, v)
    return along_residual(grad, v.detach() - u)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--words", type=int, default=12)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--noises", type=int, default=4, help="fresh forward-process noises per sample and step")
    ap.add_argument("--steps", default="1,2,3,4,6,8", help="grid steps k (of the preset's 10)")
    ap.add_argument("--checkpoint", default=None, help="textbed checkpoint dir (default: the bundled one)")
    ap.add_argument("--lora", default=None, help="a trained adapter to load (e.g. a run's lora_best/)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    device = torch.device(args.device)
    model = load_renderer(args.checkpoint, device, args.lora)
    W, G = args.words, args.group
    words = load_prompts("textbed:heldout", require_quoted=True)[:W]
    prompts = [w for w in words for _ in range(G)]
    s = validation_sampling(preset_rollout(guidance_scale=1.0, micro_batch=W * G), 10)
    with torch.no_grad():
        traj = DiffusersEngine(model).generate(prompts, list(range(5000, 5000 + W * G)), s)
    scores = torch.as_tensor(np.asarray(build_reward("ocr")(traj.images.cpu().numpy(), prompts).scores))
    adv = group_advantages(scores.float(), G)
    assert traj.x0 is not None
    x0, cond = traj.x0.float(), model.encode(prompts)
    print(f"{W} words x {G} samples, OCR mean {scores.mean():.3f}, {args.noises} noises a sample and step\n")
    losses = [("awm", 0.25), ("awm", 1.0), ("nft-adaptive", 0.0), ("nft-uniform", 0.0)]
    names = [f"awm p={p:g}" if n == "awm" else n for n, p in losses]
    print("| grid step | sigma | within-group corr(m, OCR) | " + " | ".join(names) + " |")
    print("|---" * (3 + len(names)) + "|")
    for k in map(int, args.steps.split(",")):
        t = traj.sigmas[k].expand(W * G).float()
        shares = {n: [] for n in names}
        corr = []
        for j in range(args.noises):
            noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(100 * k + j)).to(device)
            x_t = sde.forward_noise(x0, noise, t)
            with torch.no_grad():
                v = model.velocity(x_t, t, cond, guidance_scale=1.0).float()
            u = noise - x0
            m = ((v - u) ** 2).mean(tuple(range(1, v.ndim))).reshape(W, G)
            sc = scores.reshape(W, G)
            corr += [float(np.corrcoef(m[i].cpu(), sc[i])[0, 1]) for i in range(W) if sc[i].std() > 0]
            for (n, p), name in zip(losses, names):
                shares[name].append(net_share(coefficients(n, v, u, x_t, x0, t, adv, p=p), G))
        cells = [
            f"{torch.stack(shares[n]).mean():+.3f} ± {torch.stack(shares[n]).mean(0).std():.3f}"
            for n in names
        ]
        print(f"| {k} | {float(t[0]):.2f} | {np.mean(corr):+.2f} | " + " | ".join(cells) + " |")
    print("\ncells: the groups' net share sum(c) / sum(|c|), mean ± std over the groups (noises averaged)")


if __name__ == "__main__":
    main()
