"""Flow-GRPO on a 2-D toy: a CPU testbed that learns in seconds, with the real core functions.

A tiny MLP velocity model is first fitted by flow matching to a mixture of Gaussians at the corners of
a square. Then Flow-GRPO fine-tunes it to put its samples in one chosen corner, in the loop order of the
real trainer (src/fgrpo/train.py):

    rollout (ODE steps, SDE inside each sample's window; x_t, x_next, log-prob recorded)
    -> reward (1 if the sample's nearest mode is the target, else 0)
    -> group advantages -> clipped per-step policy loss on the window steps -> optimizer step.

Every formula comes from fgrpo.core (schedule.sample_windows, sde.step_mean_std / sample / log_prob,
grpo.group_advantages / clipped_policy_loss). How it deviates from the paper's setup: there is no prompt
(each group of G samples is one "prompt" repeated), no CFG, no KL and no LoRA; the model is trained in
full, and one rollout feeds `updates_per_rollout` optimizer steps on disjoint chunks of it.

CPU:   uv run python experiments/toy_2d.py default        (about 10 s)
       uv run python experiments/toy_2d.py tiny            (the smoke-test settings)
       uv run python experiments/toy_2d.py default --grpo.sde-kind cps --grpo.noise-level 0.5
There is no GPU command: the toy is meant for a laptop.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fgrpo.core import grpo, schedule, sde
from fgrpo.errors import ConfigError, cli


@dataclass(frozen=True)
class DataConfig:
    """The 2-D mixture the model is pretrained on."""

    mode_radius: float = 2.0
    """Modes sit at (+-r, +-r): four corners of a square."""
    mode_std: float = 0.3
    """Std of each (isotropic) mode."""
    target_mode: int = 0
    """Index of the rewarded mode, 0..3 in the order (+,+), (+,-), (-,+), (-,-)."""


@dataclass(frozen=True)
class PretrainConfig:
    """Flow-matching fit of the base model."""

    steps: int = 1500
    """Optimizer steps of the flow-matching fit."""
    batch: int = 512
    """Data samples per step."""
    lr: float = 3e-3
    """Adam learning rate (cosine-decayed to 0)."""
    hidden: int = 128
    """Width of the two hidden layers of the MLP."""


@dataclass(frozen=True)
class GRPOConfig:
    """Flow-GRPO fine-tuning."""

    steps: int = 40
    """Rollout + update rounds."""
    num_groups: int = 16
    """Groups per rollout (the toy's "prompts")."""
    group_size: int = 8
    """Samples per group (G); advantages are relative within a group."""
    num_steps: int = 10
    """Denoising steps of a rollout (uniform sigmas from 1 to 0)."""
    sde_kind: sde.SDEKind = "flow_sde"
    """Stochastic step inside the window (fgrpo.core.sde.step_mean_std)."""
    noise_level: float = 0.7
    """Noise level of the SDE step (flow_grpo's default for flow_sde)."""
    window_size: int = 2
    """Stochastic, trained steps per sample."""
    window_range: tuple[int, int] = (0, 5)
    """Steps [lo, hi) a window is drawn from; the early steps are the ones that choose a mode."""
    clip_range: float = 0.2
    """PPO clip epsilon on the per-step likelihood ratio."""
    adv_clip_max: float = 5.0
    """Advantages are clamped to +-adv_clip_max."""
    lr: float = 1e-3
    """Adam learning rate of the fine-tuning."""
    updates_per_rollout: int = 2
    """Optimizer steps per rollout, each on a disjoint chunk of the groups (ratios leave 1 after the first)."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""


@dataclass(frozen=True)
class Config:
    """Pretrain a 2-D flow model, then Flow-GRPO it towards one mode."""

    exp_name: str = Path(__file__).stem
    """Run name; defaults to this file's stem, so a copied file is a new run."""
    seed: int = 0
    """Seed of the model init, the data, the rollout noise and the windows."""
    threads: int = 1
    """torch CPU threads (tiny tensors: one thread is fastest)."""
    eval_samples: int = 2000
    """Deterministic (ODE) samples from fixed noise to measure the reward before and after GRPO."""
    out_dir: str | None = None
    """If set, config.json, this file's source and metrics.json are written to out_dir/exp_name."""
    data: DataConfig = field(default_factory=DataConfig)
    """The mixture."""
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    """The flow-matching fit."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """The Flow-GRPO fine-tuning."""

    @property
    def batch(self) -> int:
        """Samples per rollout."""
        return self.grpo.num_groups * self.grpo.group_size


def tiny() -> Config:
    """The smoke-test settings: a shorter fit and fewer GRPO rounds (a few seconds on one core)."""
    return dataclasses.replace(
        Config(eval_samples=1000),
        pretrain=PretrainConfig(steps=600, batch=256),
        grpo=GRPOConfig(steps=25),
    )


class Velocity(nn.Module):
    """v(x_t, sigma): an MLP on x_t and a few Fourier features of sigma."""

    freqs: torch.Tensor  # a registered buffer (nn.Module's attribute lookup types it as Tensor | Module)

    def __init__(self, hidden: int):
        super().__init__()
        self.register_buffer("freqs", torch.tensor([1.0, 2.0, 4.0, 8.0]) * math.pi, persistent=False)
        self.net = nn.Sequential(
            nn.Linear(2 + 1 + 8, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, 2),
        )

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:  # x [B, 2], sigma [B]
        a = sigma[:, None] * self.freqs  # [B, 4]
        return self.net(torch.cat([x, sigma[:, None], a.sin(), a.cos()], dim=1))


def mode_centres(cfg: DataConfig) -> torch.Tensor:
    r = cfg.mode_radius
    return torch.tensor([[r, r], [r, -r], [-r, r], [-r, -r]])  # [4, 2]


def sample_data(n: int, cfg: DataConfig, gen: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, 4, (n,), generator=gen)
    return mode_centres(cfg)[idx] + cfg.mode_std * torch.randn(n, 2, generator=gen)


def reward(x0: torch.Tensor, cfg: DataConfig) -> torch.Tensor:
    """1 where the sample's nearest mode is the target, else 0. [B, 2] -> [B]."""
    nearest = torch.cdist(x0, mode_centres(cfg)).argmin(dim=1)
    return (nearest == cfg.target_mode).float()


def pretrain(model: Velocity, cfg: Config, gen: torch.Generator) -> float:
    """Flow matching: x_t = (1 - s) x0 + s eps, regress v on eps - x0 with s ~ U(0, 1)."""
    p = cfg.pretrain
    opt = torch.optim.Adam(model.parameters(), lr=p.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, p.steps)
    loss = torch.zeros(())
    for _ in range(p.steps):
        x0 = sample_data(p.batch, cfg.data, gen)
        eps = torch.randn(p.batch, 2, generator=gen)
        s = torch.rand(p.batch, generator=gen)
        x_t = (1 - s[:, None]) * x0 + s[:, None] * eps
        loss = ((model(x_t, s) - (eps - x0)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return loss.item()


@torch.no_grad()
def rollout(
    model: Velocity, sigmas: torch.Tensor, windows: torch.Tensor, cfg: GRPOConfig, gen: torch.Generator
):
    """Sample B trajectories; record (x_t, x_next, log_prob) of each sample's W window steps.

    Returns x0 [B, 2], x_t [B, W, 2], x_next [B, W, 2], log_prob [B, W].
    """
    B, W = windows.shape
    x = torch.randn(B, 2, generator=gen)
    x_t_w, x_next_w, lp_w = torch.zeros(B, W, 2), torch.zeros(B, W, 2), torch.zeros(B, W)
    for i in range(len(sigmas) - 1):
        sigma, sigma_next = sigmas[i].expand(B), sigmas[i + 1].expand(B)
        v = model(x, sigma)
        noise = torch.randn(B, 2, generator=gen)  # drawn for every sample so a row's noise ignores the others
        ode_mean, _ = sde.step_mean_std(x, v, sigma, sigma_next, noise_level=0.0, kind="ode")
        mean, std = sde.step_mean_std(x, v, sigma, sigma_next, noise_level=cfg.noise_level, kind=cfg.sde_kind)
        x_sde = sde.sample(mean, std, noise)
        lp = sde.log_prob(x_sde, mean, std)
        hit = windows == i  # [B, W]: at most one True per row
        rows, pos = hit.nonzero(as_tuple=True)
        x_t_w[rows, pos], x_next_w[rows, pos], lp_w[rows, pos] = x[rows], x_sde[rows], lp[rows]
        x = torch.where(hit.any(dim=1, keepdim=True), x_sde, ode_mean)
    return x, x_t_w, x_next_w, lp_w


@torch.no_grad()
def evaluate(model: Velocity, sigmas: torch.Tensor, noise: torch.Tensor, cfg: DataConfig) -> float:
    """Mean reward of deterministic Euler samples from fixed noise."""
    x = noise
    for i in range(len(sigmas) - 1):
        s, sn = sigmas[i].expand(len(x)), sigmas[i + 1].expand(len(x))
        x, _ = sde.step_mean_std(x, model(x, s), s, sn, noise_level=0.0, kind="ode")
    return reward(x, cfg).mean().item()


def main(cfg: Config) -> dict[str, float]:
    g = cfg.grpo
    if g.window_size > g.num_steps or g.window_range[1] > g.num_steps:
        raise ConfigError(
            f"grpo.window_range={g.window_range} must lie within grpo.num_steps={g.num_steps} steps"
        )
    if g.num_groups % g.updates_per_rollout:
        raise ConfigError(
            f"grpo.updates_per_rollout={g.updates_per_rollout} must divide grpo.num_groups={g.num_groups}"
        )
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)  # model init only; every sample below comes from `gen`
    gen = torch.Generator().manual_seed(cfg.seed)
    t0 = time.perf_counter()

    model = Velocity(cfg.pretrain.hidden)
    fm_loss = pretrain(model, cfg, gen)
    sigmas = torch.linspace(1.0, 0.0, g.num_steps + 1)
    eval_noise = torch.randn(cfg.eval_samples, 2, generator=gen)
    eval_before = evaluate(model, sigmas, eval_noise, cfg.data)
    print(
        f"pretrained: flow-matching loss {fm_loss:.3f}, eval reward {eval_before:.3f} ({time.perf_counter() - t0:.1f} s)"
    )

    opt = torch.optim.Adam(model.parameters(), lr=g.lr)
    B, G, W = cfg.batch, g.group_size, g.window_size
    rewards_per_step = []
    for step in range(g.steps):
        # 1. rollout with per-sample SDE windows
        windows = schedule.sample_windows(B, W, *g.window_range, gen)  # [B, W]
        x0, x_t, x_next, old_log_prob = rollout(model, sigmas, windows, g, gen)
        # 2. reward, 3. group advantages (the G samples of a group are adjacent)
        r = reward(x0, cfg.data)
        advantages = grpo.group_advantages(r, G, std="group")
        rewards_per_step.append(r.mean().item())
        # 4. clipped per-step loss on the window steps, one optimizer step per chunk of whole groups
        stats: dict[str, list[float]] = {"clip_frac": [], "approx_kl": []}
        for chunk in torch.arange(B).chunk(g.updates_per_rollout):
            opt.zero_grad(set_to_none=True)
            for j in range(W):
                steps = windows[chunk, j]
                sigma, sigma_next = sigmas[steps], sigmas[steps + 1]
                v = model(x_t[chunk, j], sigma)
                mean, std = sde.step_mean_std(
                    x_t[chunk, j], v, sigma, sigma_next, noise_level=g.noise_level, kind=g.sde_kind
                )
                log_prob = sde.log_prob(x_next[chunk, j], mean, std)
                loss, metrics = grpo.clipped_policy_loss(
                    log_prob,
                    old_log_prob[chunk, j],
                    advantages[chunk],
                    clip_range=g.clip_range,
                    adv_clip_max=g.adv_clip_max,
                )
                (loss / W).backward()
                for k in stats:
                    stats[k].append(metrics[k].item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), g.grad_clip)
            opt.step()
        print(
            f"step {step:3d}  reward {rewards_per_step[-1]:.3f}  clip_frac {sum(stats['clip_frac']) / len(stats['clip_frac']):.2f}"
            f"  approx_kl {sum(stats['approx_kl']) / len(stats['approx_kl']):.4f}"
        )

    eval_after = evaluate(model, sigmas, eval_noise, cfg.data)
    k = max(1, g.steps // 5)
    result = {
        "eval_reward_before": eval_before,
        "eval_reward_after": eval_after,
        "rollout_reward_first": sum(rewards_per_step[:k]) / k,
        "rollout_reward_last": sum(rewards_per_step[-k:]) / k,
        "seconds": time.perf_counter() - t0,
    }
    print("final: " + "  ".join(f"{key} {val:.3f}" for key, val in result.items()))
    if cfg.out_dir is not None:
        out = Path(cfg.out_dir) / cfg.exp_name
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
        (out / Path(__file__).name).write_text(Path(__file__).read_text())
        (out / "metrics.json").write_text(
            json.dumps({**result, "rollout_reward": rewards_per_step}, indent=2)
        )
    return result


def presets() -> dict[str, tuple[str, Config]]:
    """The named starting points of the command line (tyro subcommands; flags override any field)."""
    return {
        "default": ("About 10 s on a CPU: pretrain, then 40 Flow-GRPO rounds.", Config()),
        "tiny": ("The smoke-test settings (a few seconds).", tiny()),
    }


if __name__ == "__main__":
    cli(main, presets())
