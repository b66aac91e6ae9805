"""benchmarks/peer_sampler.py runs end to end on the CPU (tiny random SD3) against a stand-in flow_grpo checkout:
a sampler of our own with flow_grpo's module path, function name and call, so no flow_grpo code is needed."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fgrpo.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}

# Plain CFG and Euler steps on the pipeline's own scheduler grid, then the VAE; log-probs of zero (a stand-in:
# the benchmark only times it and checks what it returns).
STAND_IN = """
import torch


@torch.no_grad()
def pipeline_with_logprob(
    self, prompt_embeds, pooled_prompt_embeds, negative_prompt_embeds, negative_pooled_prompt_embeds,
    num_inference_steps, guidance_scale, output_type, height, width, noise_level, generator=None,
):
    device = prompt_embeds.device
    self.scheduler.set_timesteps(num_inference_steps, device=device)
    sigmas = self.scheduler.sigmas
    embeds = torch.cat([negative_prompt_embeds, prompt_embeds])
    pooled = torch.cat([negative_pooled_prompt_embeds, pooled_prompt_embeds])
    n, scale = prompt_embeds.shape[0], self.vae_scale_factor
    shape = (n, self.transformer.config.in_channels, height // scale, width // scale)
    x = torch.randn(shape, generator=generator, device=device)
    latents, log_probs = [x], []
    for i, t in enumerate(self.scheduler.timesteps):
        out = self.transformer(
            hidden_states=torch.cat([x, x]).to(prompt_embeds.dtype),
            timestep=t.expand(2 * n),
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0].float()
        v_uncond, v_cond = out.chunk(2)
        x = x + (sigmas[i + 1] - sigmas[i]) * (v_uncond + guidance_scale * (v_cond - v_uncond))
        latents.append(x)
        log_probs.append(torch.zeros(n, device=device))
    z = x / self.vae.config.scaling_factor + self.vae.config.shift_factor
    images = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0]
    return (images / 2 + 0.5).clamp(0, 1), latents, log_probs
"""


def stand_in_checkout(root: Path) -> Path:
    """A folder laid out like a flow_grpo checkout (no __init__.py, as flow_grpo has none) holding STAND_IN."""
    patch = root / "flow_grpo" / "diffusers_patch"
    patch.mkdir(parents=True)
    (patch / "sd3_pipeline_with_logprob.py").write_text(STAND_IN)
    return root


def run_peer_sampler(
    checkout: Path, *args: str, mode: str = "eager"
) -> tuple[subprocess.CompletedProcess[str], list[list[str]]]:
    """peer_sampler.py --tiny on the stand-in checkout: the process, and the cells of the final table's rows of
    `mode`."""
    res = subprocess.run(
        [sys.executable, str(BENCH / "peer_sampler.py"), "--tiny", "--flow-grpo", str(checkout), *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = res.stdout
    table = out[out.index("| mode | sampler |") :] if "| mode | sampler |" in out else ""
    return res, [line.split("|")[1:-1] for line in table.splitlines()[2:] if line.startswith(f"| {mode} ")]


def test_peer_sampler_tiny(tmp_path):
    checkout = stand_in_checkout(tmp_path / "flow_grpo_checkout")
    profile = tmp_path / "profile"
    res, rows = run_peer_sampler(checkout, "--repeats", "2", "--profile", str(profile))
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "64x64, 10 steps, CFG 4.5, noise level 0.7, B=2" in out and "sigma grids agree" in out
    names = [r[1].strip() for r in rows]
    assert names == ["flow_grpo", "fgrpo, same work", "fgrpo, recipe SDE (cps 0.8, window 3 of [0, 5))"]
    for r in rows:
        total, fastest, transformer, outside, vae, rest, per_s, ratio = map(float, r[3:11])
        assert 0 < fastest <= total and 0 < transformer < total and 0 < vae < outside
        assert outside == pytest.approx(total - transformer, abs=2e-3)
        assert rest == pytest.approx(outside - vae, abs=2e-3)
        # total and images/s are both printed to 3 decimals, so each is within 5e-4 of the value the other came from
        assert 2 / (total + 5e-4) - 5e-4 <= per_s <= 2 / (total - 5e-4) + 5e-4 and ratio > 0
        assert int(r[11]) == 10  # one batched CFG forward per step
    assert float(rows[0][10]) == 1.0
    # the bound of a sampler's own work: flow_grpo's total over its transformer + VAE seconds
    inside, total, bound = map(float, re.search(r"# eager: flow_grpo's transformer \+ VAE take ([\d.]+) of its ([\d.]+) s, so a sampler of its work with no work of its own runs at most ([\d.]+)x it", out).groups())  # type: ignore[union-attr]  # fmt: skip
    assert total == float(rows[0][3]) and inside == pytest.approx(
        float(rows[0][5]) + float(rows[0][7]), abs=2e-3
    )
    # the seconds are printed to 1 ms, the bound from the unrounded ones: it lies within their rounding
    lo, hi = (total - 5e-4) / (inside + 5e-4), (total + 5e-4) / (inside - 5e-4)
    assert lo - 1e-3 <= bound <= hi + 1e-3 and bound > 1
    # log-probs per image: every step for flow_grpo and the same-work row, the recipe's window of 3
    assert [int(r[12]) for r in rows] == [10, 10, 3]
    # the CPU has no host syncs to count and no peak memory
    assert all(r[13].strip() == "-" == r[14].strip() for r in rows)
    traces = sorted(p.name for p in profile.glob("*.json"))
    assert len(traces) == 3 and all(t.startswith("eager_") for t in traces)
    assert "Self CPU" in (profile / "eager_flow_grpo.txt").read_text()
    assert "## profile, eager, flow_grpo: " in out


def test_peer_sampler_needs_a_checkout(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.delitem(sys.modules, "peer_sampler", raising=False)  # put back as it was after the test
    module = load_script(BENCH / "peer_sampler.py")
    with pytest.raises(SystemExit, match="pass the root of a flow_grpo checkout"):
        module.load_flow_grpo_sampler(tmp_path)


def test_peer_sampler_with_the_policys_lora(tmp_path):
    """--lora R: the shared transformer carries a LoRA (both samplers run it) and a merged-rollout row is added."""
    checkout = stand_in_checkout(tmp_path / "flow_grpo_checkout")
    res, rows = run_peer_sampler(checkout, "--repeats", "1", "--lora", "4")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "LoRA r4 on 8 projections" in res.stdout
    assert [r[1].strip() for r in rows][-1] == "fgrpo, recipe, merged" and len(rows) == 4
    assert int(rows[-1][12]) == 3  # the recipe's window keeps its log-probs
    bad, _ = run_peer_sampler(checkout, "--lora", "-1")
    assert bad.returncode != 0 and "--lora -1" in bad.stderr


def test_peer_sampler_compiled_rows_decode_with_their_own_compiled_vae(tmp_path):
    """The compile mode adds rows that decode with fgrpo's own copy of the VAE, its decoder compiled as model.compile
    compiles it; the VAE clock times every VAE's decode (the compiled decoder's own hooks would run inside its
    graph). The "eager" backend traces as inductor does without making kernels."""
    checkout = stand_in_checkout(tmp_path / "flow_grpo_checkout")
    args = ("--repeats", "1", "--lora", "4", "--modes", "compile", "--compile-backend", "eager")
    res, rows = run_peer_sampler(checkout, *args, mode="compile")
    assert res.returncode == 0, res.stderr[-3000:]
    names = [r[1].strip() for r in rows]
    assert names[0] == "flow_grpo" and names[-2:] == [
        "fgrpo, same work, compiled VAE",
        "fgrpo, recipe, merged, compiled VAE",
    ]
    assert len(rows) == 6
    for r in rows:
        assert 0 < float(r[7]) < float(r[6])  # the VAE's seconds, within the seconds outside the transformer
    assert [int(r[12]) for r in rows[-2:]] == [10, 3]
