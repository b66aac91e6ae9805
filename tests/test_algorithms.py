"""The algorithms in the loop (fgrpo/algorithms.py): each one trains end to end, samples what it says, keeps
its exactness promises (the first update's ratio is 1, Flow-DPPO needs no recompute pass), and NFT's EMA old
policy behaves as core.ema says and resumes exactly. Tiny random Qwen-Image on the CPU (tests/train_entry.py)."""

import dataclasses
from pathlib import Path

import pytest
import torch
from train_entry import Config

from fgrpo import algorithms, checkpoint, files
from fgrpo import train as train_mod
from fgrpo.algorithms import check_config
from fgrpo.core import schedule
from fgrpo.rollout.engine import DiffusersEngine
from fgrpo.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def cfg_for(tmp_path, name, num_steps=2, **algo):
    c = Config()
    grpo = dataclasses.replace(c.grpo, clip_range=1.0) if name == "awm" else c.grpo
    return dataclasses.replace(
        c,
        num_steps=num_steps,
        grpo=grpo,
        algo=dataclasses.replace(c.algo, name=name, **algo),
        run=dataclasses.replace(c.run, out_dir=str(tmp_path)),
    )


class Recording(DiffusersEngine):
    """The in-process engine, remembering each rollout's sampling config and trajectory."""

    seen: list = []

    def generate(self, prompts, seeds, cfg, *a, **kw):
        traj = super().generate(prompts, seeds, cfg, *a, **kw)
        Recording.seen.append((cfg, traj))
        return traj


@pytest.fixture
def recording(monkeypatch):
    Recording.seen = []
    monkeypatch.setattr(train_mod, "build_engine", lambda model, engine, path, **kw: Recording(model))
    return Recording.seen


@pytest.mark.parametrize("name", ["dppo", "mixgrpo", "nft", "awm"])
def test_each_algorithm_trains_end_to_end(tmp_path, name, recording):
    """Two steps: the weights move, the losses are finite, and the first update of the on-policy ones is exact."""
    m = train_mod.train(cfg_for(tmp_path, name, window_iters=1))
    assert m["train/skipped_steps"] == 0 and m["train/optimizer_steps"] == 2
    assert all(torch.isfinite(torch.tensor(v)) for k, v in m.items() if k.startswith("train/"))
    latest = checkpoint.latest(tmp_path / "e2e" / "checkpoints")
    assert latest is not None
    w1 = files.read_tensors(latest / "model.safetensors")
    assert max(t.abs().max().item() for k, t in w1.items() if "lora_B" in k) > 0  # B starts at 0: it trained
    cfgs = [c for c, _ in recording]
    if name in ("nft", "awm"):  # ODE rollouts, no window, clean latents kept
        assert all(c.window_size == 0 and c.sde_kind == "ode" for c in cfgs)
        assert all(t.x0 is not None for _, t in recording)
    if name == "mixgrpo":  # one window for the whole batch, at sliding_window's position for each step
        for step, (_cfg, traj) in enumerate(recording):
            want = schedule.sliding_window(
                step, num_steps=4, window_size=2, iters_per_window=1, lo=0, roll_back=True
            )
            assert traj.window.tolist() == [want] * len(traj)


def test_mixgrpo_window_in_range_stays_inside_window_range(tmp_path):
    """10 sampling steps, window 2, range (0, 5): in range the window takes starts 0-3 and rolls back; over the
    reference's range it reaches start 7 (steps 7 and 8, every step but the last)."""
    cfg = cfg_for(tmp_path, "mixgrpo", window_iters=1)
    cfg = dataclasses.replace(
        cfg, sampling=dataclasses.replace(cfg.sampling, num_steps=10, window_size=2, window_range=(0, 5))
    )
    starts = [algorithms.build(cfg, []).sampling(k).window_range for k in range(9)]
    assert starts == [(i, i + 2) for i in range(8)] + [(0, 2)]
    in_range = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, window_in_range=True))
    starts = [algorithms.build(in_range, []).sampling(k).window_range for k in range(6)]
    assert starts == [(0, 2), (1, 3), (2, 4), (3, 5), (0, 2), (1, 3)]


@pytest.mark.parametrize("name", ["awm", "dppo"])
def test_first_update_is_exactly_on_policy(tmp_path, name, monkeypatch):
    """AWM's old log-weights come from a no-grad pass over the training forwards' rows, Flow-DPPO's old means from
    the rollout itself (a recompute pass would be the only other source: it is made to fail here)."""

    def no_recompute(*a, **k):
        raise AssertionError("Flow-DPPO recomputed the old means")

    monkeypatch.setattr(algorithms, "recompute_log_probs_and_means", no_recompute)
    cfg = cfg_for(tmp_path, name, num_steps=1)
    m = train_mod.train(
        dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, optimizer_steps_per_step=1))
    )
    assert m["train/ratio_min"] == m["train/ratio_max"] == 1.0
    if name == "dppo":
        assert m["train/masked_frac"] == 0.0  # D = 0 < tau everywhere at unchanged weights


def test_nft_samples_with_the_ema_and_the_ema_follows_core_ema(tmp_path, monkeypatch):
    """old <- d old + (1 - d) theta after each step with d = ema_decay(optimizer steps done): 0.2 after step 0
    (2 optimizer steps, rate 0.1), 0.4 after step 1; step 1's rollout samples with the old weights."""
    sampled = []

    class Weighing(DiffusersEngine):
        def generate(self, prompts, seeds, cfg, *a, **kw):
            ps = [p for p in self.model.transformer.parameters() if p.requires_grad]
            sampled.append([algorithms._local(p).detach().clone() for p in ps])
            return super().generate(prompts, seeds, cfg, *a, **kw)

    monkeypatch.setattr(train_mod, "build_engine", lambda model, engine, path, **kw: Weighing(model))
    calls = []
    real_update = algorithms.EmaWeights.update

    def spy(self, done):
        before = [t.clone() for t in self.tensors]
        d = real_update(self, done)
        theta = [algorithms._local(p).detach().clone() for p in self.params]
        calls.append((done, d, before, [t.clone() for t in self.tensors], theta))
        return d

    monkeypatch.setattr(algorithms.EmaWeights, "update", spy)
    train_mod.train(cfg_for(tmp_path, "nft", num_steps=2, ema_rate=0.1, ema_max_decay=0.9, ema_delay=0))
    assert [(c[0], c[1]) for c in calls] == [(2, pytest.approx(0.2)), (4, pytest.approx(0.4))]
    for _done, d, before, after, theta in calls:
        for b, a, t in zip(before, after, theta):
            torch.testing.assert_close(a, d * b + (1 - d) * t)
    assert all(
        torch.equal(s, b) for s, b in zip(sampled[0], calls[0][2])
    )  # step 0: the EMA = the initial theta
    assert all(torch.equal(s, a) for s, a in zip(sampled[1], calls[0][3]))  # step 1: the EMA after step 0
    assert any(not torch.equal(s, t) for s, t in zip(sampled[1], calls[0][4]))  # ... which is not theta


@pytest.mark.parametrize(
    ("name", "ema"),
    [
        ("nft", {"ema_rate": 0.3, "ema_max_decay": 0.9, "ema_delay": 1}),
        ("awm", {"kl_ema_rate": 0.3, "kl_ema_max_decay": 0.9}),
    ],
)
def test_ema_resume_is_exact(tmp_path, name, ema):
    """2 steps straight = 1 step, then a resume for the second: the EMA (NFT's old policy, AWM's KL anchor) is
    restored from the checkpoint."""
    straight = cfg_for(tmp_path / "a", name, num_steps=2, **ema)
    train_mod.train(straight)
    first = dataclasses.replace(cfg_for(tmp_path / "b", name, num_steps=1, **ema))
    train_mod.train(first)
    resumed = dataclasses.replace(
        straight, run=dataclasses.replace(straight.run, out_dir=str(tmp_path / "b"), resume="auto")
    )
    train_mod.train(resumed)
    a = checkpoint.latest(tmp_path / "a" / "e2e" / "checkpoints")
    b = checkpoint.latest(tmp_path / "b" / "e2e" / "checkpoints")
    assert a is not None and b is not None
    for f in ("model.safetensors", "tensors_rank0.safetensors"):
        ta, tb = files.read_tensors(a / f), files.read_tensors(b / f)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), f


def test_nft_point_loss_reads_its_weighting(tmp_path):
    """algo.nft_weighting reaches core.nft.nft_loss: the point loss equals the core loss with the same weighting,
    and the two weightings differ on the same tensors."""
    from fgrpo.core import nft

    v = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    v_old, x0 = torch.zeros(2, 2), torch.zeros(2, 2)
    x_t, sigma, adv = torch.ones(2, 2), torch.tensor([0.5, 0.75]), torch.tensor([1.0, -1.0])
    losses = {}
    for weighting in ("adaptive", "uniform"):
        cfg = cfg_for(tmp_path, "nft", num_steps=1, nft_weighting=weighting)
        algo = algorithms.build(cfg, [torch.nn.Parameter(torch.zeros(2))])
        assert isinstance(algo, algorithms.DiffusionNFT)
        loss, _ = algo.point_loss(v, x_t, x0, None, sigma, {"v_old": v_old}, adv)
        r = nft.optimality_prob(adv, adv_clip=cfg.grpo.adv_clip_max)
        want, _ = nft.nft_loss(
            v,
            v_old,
            x_t,
            x0,
            sigma,
            r,
            beta=cfg.algo.nft_beta,
            scale=cfg.grpo.adv_clip_max,
            weighting=weighting,
        )
        torch.testing.assert_close(loss, want)
        losses[weighting] = loss.item()
    assert losses["adaptive"] != pytest.approx(losses["uniform"])


def test_awm_adds_the_kl_to_its_ema_and_the_ema_follows_core_ema(tmp_path, monkeypatch):
    """The point loss is awm_loss + ema_kl_coef * mean((v - v_ema)^2) (hand-made tensors); in the loop the
    EMA's decay is min(rate * optimizer steps done, max): 0.2 after step 0 (2 steps, rate 0.1), then 0.3."""
    from fgrpo.core import awm

    cfg = cfg_for(tmp_path, "awm", num_steps=2, ema_kl_coef=0.5, kl_ema_rate=0.1, kl_ema_max_decay=0.3)
    params = [torch.nn.Parameter(torch.zeros(2))]
    algo = algorithms.build(cfg, params)
    assert isinstance(algo, algorithms.AWM)
    v = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    x0, noise, sigma = torch.zeros(2, 2), torch.ones(2, 2), torch.tensor([0.5, 0.5])
    old = {"log_weight": torch.tensor([-1.0, -0.5]), "v_ema": torch.tensor([[1.0, 0.0], [0.0, 1.0]])}
    adv = torch.tensor([1.0, -1.0])
    loss, metrics = algo.point_loss(v, None, x0, noise, sigma, old, adv)
    lw = awm.awm_log_weight(v, x0, noise, sigma, p=0.25)
    surrogate, _ = awm.awm_loss(lw, old["log_weight"], adv, adv_clip=cfg.grpo.adv_clip_max, clip_range=1.0)
    # (v - v_ema)^2: row 0 [0, 4] -> 2, row 1 [0, 0] -> 0; batch mean 1
    assert metrics["ema_kl"].item() == 1.0
    torch.testing.assert_close(loss, surrogate + 0.5 * 1.0)
    off = algorithms.build(
        dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, ema_kl_coef=0.0)), params
    )
    assert isinstance(off, algorithms.AWM)
    assert off.state() == {} and "ema_kl" not in off.point_loss(v, None, x0, noise, sigma, old, adv)[1]

    calls = []
    real_update = algorithms.EmaWeights.update
    monkeypatch.setattr(
        algorithms.EmaWeights,
        "update",
        lambda self, done: calls.append((done, real_update(self, done))) or calls[-1][1],
    )
    m = train_mod.train(cfg)
    assert calls == [(2, pytest.approx(0.2)), (4, pytest.approx(0.3))]
    assert m["train/ema_decay"] == pytest.approx(0.3) and m["train/ema_kl"] >= 0


def test_forward_process_settings_are_checked(tmp_path):
    base = cfg_for(tmp_path, "nft")
    bad = dataclasses.replace(base, algo=dataclasses.replace(base.algo, train_steps=9, train_steps_hi=3))
    with pytest.raises(ValueError, match="algo.train_steps=9"):
        check_config(bad, world_size=1)
    with pytest.raises(ValueError, match="--grpo.ratio-norm"):
        check_config(
            dataclasses.replace(base, grpo=dataclasses.replace(base.grpo, ratio_norm=True)), world_size=1
        )
    # an ODE sampling config is fine for NFT (nothing trains the window) and refused for Flow-GRPO
    ode = dataclasses.replace(base.sampling, sde_kind="ode", window_size=0)
    check_config(dataclasses.replace(base, sampling=ode), world_size=1)
    with pytest.raises(ValueError, match="nothing to train"):
        check_config(dataclasses.replace(base, sampling=ode, algo=Config().algo), world_size=1)


@pytest.mark.parametrize("name", ["awm", "nft"])
def test_sde_steps_sample_those_grid_steps_stochastically(tmp_path, name, recording):
    """algo.sde_steps (1, 3): every rollout is the SDE on grid steps 1-2 (one window for the whole batch) and the
    ODE elsewhere, at sampling.noise_level; (0, 0), the default, samples with the ODE throughout. A range past the grid or without a stochastic step is refused in one line."""
    cfg = cfg_for(tmp_path, name, num_steps=1, sde_steps=(1, 3))
    train_mod.train(cfg)
    (scfg, traj), *_ = recording
    assert (scfg.window_range, scfg.window_size, scfg.sde_kind) == ((1, 3), 2, cfg.sampling.sde_kind)
    assert traj.window.tolist() == [[1, 2]] * len(traj)
    algo = algorithms.build(cfg, [])
    ode = algorithms.build(dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, sde_steps=(0, 0))), [])
    assert (ode.sampling(0).sde_kind, ode.sampling(0).window_size) == ("ode", 0)
    assert algo.sampling(0).noise_level == cfg.sampling.noise_level > 0
    with pytest.raises(ValueError, match=r"algo.sde_steps=\(1, 99\) must satisfy"):
        check_config(
            dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, sde_steps=(1, 99))), world_size=1
        )
    ode_kind = dataclasses.replace(cfg.sampling, sde_kind="ode")
    with pytest.raises(ValueError, match="needs a stochastic step"):
        check_config(dataclasses.replace(cfg, sampling=ode_kind), world_size=1)


def test_forward_process_is_a_property_of_the_algorithm_class():
    """NFT and AWM sample with the ODE and train fresh forward-process points; the window algorithms do not."""
    assert {n for n, a in algorithms.ALGORITHMS.items() if a.forward_process} == {"nft", "awm"}


def test_each_forward_process_algorithm_checks_its_own_fields(tmp_path):
    """NFT refuses a non-positive nft_beta and AWM a non-positive awm_p, each in one line naming the field; neither
    checks the other's field, which it never reads."""

    def zero(name, field):
        c = cfg_for(tmp_path, name)
        return dataclasses.replace(c, algo=dataclasses.replace(c.algo, **{field: 0.0}))

    for name, field, other in (("nft", "nft_beta", "awm"), ("awm", "awm_p", "nft")):
        with pytest.raises(ValueError, match=rf"^algo\.{field}=0\.0 is out of range"):
            check_config(zero(name, field), world_size=1)
        check_config(zero(other, field), world_size=1)


def _budget(c):
    """What the algorithm presets keep from their base preset."""
    return (
        c.num_steps,
        c.grpo.group_size,
        c.grpo.prompts_per_step,
        dataclasses.replace(c.optim, lr=0.0, eps=0.0),  # lr, eps and optimizer steps: per-algorithm (below)
        c.model,
        c.data,
        c.sampling.num_steps,
    )


def test_every_algorithm_preset_validates_and_keeps_the_base_budget():
    m = load_script(ROOT / "experiments" / "qwen_image_ocr.py")
    presets = m.presets()
    for algo in ("dppo", "mixgrpo", "nft", "awm"):
        for suffix, base in (("", m.Config()), ("-tiny", m.tiny()), ("-tiny-gpu", m.tiny_gpu())):
            cfg = presets[algo + suffix][1]
            assert cfg.algo.name == algo
            check_config(cfg, world_size=1)
            assert _budget(cfg) == _budget(base)
            long_gpu = suffix == "-tiny-gpu"
            # the renderer's 300-step runs halved MixGRPO's and AWM's lr (qwen_image_ocr.tiny_gpu_values)
            half = algo == "mixgrpo" and long_gpu
            assert cfg.optim.lr == base.optim.lr / (2 if half or (algo == "awm" and long_gpu) else 1)
            assert cfg.algo.window_in_range == half
            # and kept MixGRPO's shared window off the low-noise steps 3-4 (RESULTS.md, stability-8)
            assert cfg.sampling.window_range == ((0, 4) if half else base.sampling.window_range)
            # AWM's: one optimizer step a rollout and a KL of 0.03 to the frozen model (RESULTS.md, stability-10)
            awm_gpu = algo == "awm" and long_gpu
            base_steps = base.grpo.optimizer_steps_per_step
            assert cfg.grpo.optimizer_steps_per_step == (1 if awm_gpu else base_steps)
            # and Adam's epsilon 5e-6, which damps the coordinates with small gradients (RESULTS.md, stability-12)
            assert cfg.optim.eps == (5e-6 if awm_gpu else base.optim.eps)
            if algo == "awm":
                assert cfg.grpo.kl_coef == (0.03 if awm_gpu else base.grpo.kl_coef if suffix else 3e-3)
            if algo == "nft":
                # the long GPU runs: beta 1 (the OCR recipe's 0.1 elsewhere), an old policy that follows theta
                # (decay <= 0.5 from the first step) and a KL of 0.3 to the frozen model (RESULTS.md, stability-7)
                a = cfg.algo
                assert a.nft_beta == (1.0 if long_gpu else 0.1)
                following = (a.ema_rate, a.ema_max_decay, a.ema_delay) == (0.001, 0.5, 0)
                assert following == long_gpu
                assert cfg.grpo.kl_coef == (0.3 if long_gpu else 0.0 if suffix == "-tiny" else 1e-4)
            # NFT's and AWM's long GPU runs train the high-noise grid steps only (below 5), the others every step
            assert (cfg.algo.train_steps_hi == 5) == (algo in ("nft", "awm") and long_gpu)
    assert set(algorithms.ALGORITHMS) == {"grpo", "dppo", "mixgrpo", "nft", "awm"}


@pytest.mark.parametrize("shared", [False, True])
def test_training_points_do_not_depend_on_the_batch_a_sample_is_in(shared):
    """NFT/AWM points come from each sample's own seed: the rows of a rank's slice equal those of the whole batch
    (so 2 ranks train the points 1 rank would); shared steps come from the step's stream, alike on every rank."""
    from types import SimpleNamespace

    x0 = torch.randn(6, 3, 4)
    traj = SimpleNamespace(
        x0=x0, seeds=torch.tensor([11, 12, 13, 14, 15, 16]), sigmas=torch.linspace(1, 0, 11)
    )

    def gen():
        return torch.Generator().manual_seed(5)

    full = algorithms.draw_points(traj, 3, (0, 10), gen(), shared=shared)  # pyright: ignore[reportArgumentType] - a stand-in with the fields draw_points reads
    part = algorithms.draw_points(
        SimpleNamespace(x0=x0[3:], seeds=traj.seeds[3:], sigmas=traj.sigmas),  # pyright: ignore[reportArgumentType] - a stand-in with the fields draw_points reads
        3,
        (0, 10),
        gen(),
        shared=shared,
    )
    assert torch.equal(part.noise, full.noise[3:]) and torch.equal(part.sigma, full.sigma[3:])
    assert not torch.equal(full.noise[0], full.noise[1])  # different samples, different noise


def test_rollout_fields_for_vllm_omni_are_what_the_update_reads(tmp_path):
    """An engine in another process sends back only these: the clean latents for NFT and AWM; the rollout's
    transition means for a loss that reads them (Flow-DPPO, --grpo.ratio-norm) while the rollout's log-probs are
    kept, and none once the old log-probs are recomputed (the recompute pass gives the old means too)."""

    def fields(name, **grpo):
        c = cfg_for(tmp_path, name)
        c = dataclasses.replace(c, grpo=dataclasses.replace(c.grpo, **grpo))
        return algorithms.build(c, []).rollout_fields()

    assert fields("nft") == fields("awm") == ("x0",)
    assert fields("dppo") == fields("grpo", ratio_norm=True) == ("mean",)
    assert fields("grpo") == fields("mixgrpo") == ()
    assert (
        fields("dppo", old_log_prob="recompute")
        == fields("grpo", ratio_norm=True, old_log_prob="recompute")
        == ()
    )
