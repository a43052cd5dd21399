import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from runtime.flowgrpo.mot import (
    BAGEL_KEY_MAP,
    BagelMoT,
    BagelMoTFlowGRPO,
    from_bagel_keys,
    guide_velocity,
    load_bagel_checkpoint,
    save_bagel_checkpoint,
    to_bagel_keys,
)
from runtime.flowgrpo.registry import get_diffusion_model_cls
from runtime.flowgrpo.rewards import LatentMeanReward
from runtime.flowgrpo.rollout import rollout
from runtime.flowgrpo.trainer import FlowGRPOTrainer, GRPOConfig

B, STEPS, WINDOW, SHAPE = 3, 4, 2, (4, 8, 8)


def _model(seed=0, **cfg):
    torch.manual_seed(seed)
    return BagelMoT(cfg)


def _batch(b=B, cond=True):
    g = torch.Generator().manual_seed(5)
    batch = {
        "input_ids": torch.randint(0, 60, (b, 5), generator=g),
        "attention_mask": torch.ones(b, 5, dtype=torch.bool),
    }
    batch["attention_mask"][0, -2:] = False  # a padded prompt
    if cond:
        batch["cond_latents"] = torch.randn(b, *SHAPE, generator=g)
    return batch


def _vel(seed, b=2):
    return torch.randn(b, 4, 2, 2, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ guidance: gating and renorm on hand-made inputs
def test_guidance_formula_and_gating():
    vu, vt, vf = _vel(0), _vel(1), _vel(2)
    sigma = torch.tensor([0.5, 0.9])
    out = guide_velocity(vu, vt, vf, sigma, text_scale=4.0, image_scale=1.5, interval=(0.2, 0.8), renorm=False)
    expected0 = vu[0] + 4.0 * (vt[0] - vu[0]) + 1.5 * (vf[0] - vt[0])
    torch.testing.assert_close(out[0], expected0)
    assert torch.equal(out[1], vf[1])  # sigma 0.9 outside the interval: the conditional branch alone
    # bounds are inclusive; two-branch form without the full branch
    out2 = guide_velocity(vu, vt, None, torch.tensor([0.2, 0.8]), text_scale=3.0, interval=(0.2, 0.8), renorm=False)
    torch.testing.assert_close(out2, vu + 3.0 * (vt - vu))
    out3 = guide_velocity(vu, vt, None, 0.1, text_scale=3.0, interval=(0.2, 0.8))
    assert torch.equal(out3, vt)


def test_renorm_per_sample_and_clamp():
    vu, vt = _vel(3), _vel(4)
    vt[1] *= 10  # very different norms per sample
    out = guide_velocity(vu, vt, None, 0.5, text_scale=5.0, renorm=True)
    raw = vu + 5.0 * (vt - vu)
    for i in range(2):
        torch.testing.assert_close(out[i].norm(), vt[i].norm())  # rescaled to the conditional norm
        torch.testing.assert_close(out[i] / out[i].norm(), raw[i] / raw[i].norm())  # direction kept
    # a clamp caps the scale: (0, 1) only ever shrinks (BAGEL's "global" renorm with cfg_renorm_min=0)
    small = 0.01 * vu
    vt_small = 0.01 * vt
    g = guide_velocity(small, vt_small, None, 0.5, text_scale=1.0, renorm=True, renorm_clamp=(0.0, 1.0))
    torch.testing.assert_close(g, vt_small)  # scale 1 exactly when guided == cond
    hand_u = torch.zeros(1, 2)
    hand_t = torch.tensor([[3.0, 4.0]])  # norm 5
    g = guide_velocity(hand_u + 1.0, hand_t, None, 0.5, text_scale=2.0, renorm=True, renorm_clamp=(0.0, 1.0))
    raw = torch.tensor([[5.0, 7.0]])  # 1 + 2 (t - 1)
    torch.testing.assert_close(g, raw * (5.0 / raw.norm()))
    g = guide_velocity(hand_u, 0.1 * hand_t, None, 0.5, text_scale=0.5, renorm=True, renorm_clamp=(0.0, 1.0))
    torch.testing.assert_close(g, 0.05 * hand_t)  # scale would be 2, clamped to 1
    g = guide_velocity(hand_u, 0.1 * hand_t, None, 0.5, text_scale=0.5, renorm=True, renorm_clamp=(0.0, 1.5))
    torch.testing.assert_close(g, 0.075 * hand_t)


# ------------------------------------------------------------------ the model
def test_mot_forward_pathways_and_masks():
    m = _model().eval()
    x = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 60, (2, 5), generator=torch.Generator().manual_seed(2))
    t = torch.tensor([0.3, 0.9])
    with torch.no_grad():
        v = m(ids, x, t)
        assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
        # the generation pathway is a separate set of weights: perturbing the text pathway's MLP changes the
        # latents' output only through attention, perturbing the gen MLP changes it directly
        base = m(ids, x, t)
        for mlp, changes in ((m.layers[-1].mlp_moe_gen, True), (m.layers[-1].mlp, False)):
            # (the last layer's text MLP only touches text rows, which nothing reads afterwards)
            saved = mlp.down_proj.weight.clone()
            mlp.down_proj.weight.add_(0.1)
            assert torch.equal(m(ids, x, t), base) != changes
            mlp.down_proj.weight.copy_(saved)
        # a fully masked prompt is the same as any other fully masked prompt (the text is really hidden)
        off = torch.zeros(2, 5, dtype=torch.bool)
        a = m(ids, x, t, text_mask=off)
        b = m(torch.randint(0, 60, (2, 5), generator=torch.Generator().manual_seed(9)), x, t, text_mask=off)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert not torch.allclose(a, base)
        # rows are independent (batch of 2 == two batches of 1)
        torch.testing.assert_close(m(ids[1:], x[1:], t[1:]), base[1:], rtol=0, atol=1e-6)


def test_attention_runs_in_bf16(monkeypatch):
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    m = _model().to(torch.bfloat16).eval()
    with torch.no_grad():
        v = m(torch.randint(0, 60, (2, 5)), torch.randn(2, *SHAPE), torch.tensor([0.5, 0.5]))
    assert seen and all(d == (torch.bfloat16,) * 3 for d in seen)
    assert torch.isfinite(v).all()
    seen.clear()
    with torch.no_grad():
        _model()(torch.randint(0, 60, (1, 5)), torch.randn(1, *SHAPE), torch.tensor([0.5]))
    assert seen and all(d == (torch.float32,) * 3 for d in seen)


def test_bagel_checkpoint_round_trip(tmp_path):
    src = _model(seed=1)
    ours = src.state_dict()
    bagel = to_bagel_keys(ours)
    assert "language_model.model.layers.0.self_attn.q_proj_moe_gen.weight" in bagel
    assert "language_model.model.norm.weight" in bagel and "language_model.model.norm_moe_gen.weight" in bagel
    assert "language_model.lm_head.weight" in bagel and "vae2llm.weight" in bagel
    back, unmapped = from_bagel_keys(bagel)
    assert not unmapped and back.keys() == ours.keys()
    assert all(any(k.startswith(s) for s, _ in BAGEL_KEY_MAP) for k in bagel)
    # an ema.safetensors with an understanding tower we do not have: skipped; an unknown key: reported
    path = tmp_path / "ema.safetensors"
    save_file({**bagel, "vit_model.encoder.w": torch.randn(2)}, str(path))
    dst = _model(seed=2)
    assert load_bagel_checkpoint(dst, str(path)) == ([], [])
    for k, v in dst.state_dict().items():
        assert torch.equal(v, ours[k]), k
    x, ids, t = torch.randn(1, *SHAPE), torch.randint(0, 60, (1, 5)), torch.tensor([0.4])
    with torch.no_grad():
        assert torch.equal(src(ids, x, t), dst(ids, x, t))
    save_file({**bagel, "mystery.w": torch.randn(2)}, str(path))
    with pytest.raises(KeyError, match="mystery"):
        load_bagel_checkpoint(_model(), str(path))
    # save_bagel_checkpoint writes BAGEL's names (base weights, LoRA left out)
    src.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj_moe_gen", "v_proj_moe_gen"]))
    save_bagel_checkpoint(src, str(tmp_path / "out.safetensors"))
    assert load_file(str(tmp_path / "out.safetensors")).keys() == bagel.keys()


# ------------------------------------------------------------------ the adapter
def _adapter(**kw):
    cls = get_diffusion_model_cls("BagelMoT", "flowgrpo")
    assert cls is BagelMoTFlowGRPO
    return cls({"shift": 3.0}, text_guidance_scale=3.0, image_guidance_scale=1.5, cfg_interval=(0.3, 0.95), **kw)


def test_adapter_branches_match_manual_cfg():
    adapter, m = _adapter(cfg_renorm=False), _model().eval()
    batch = {**_batch(), "schedule": adapter.set_timesteps(STEPS)}
    x = torch.randn(B, *SHAPE, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for i in range(STEPS):
            v = adapter.velocity(m, batch, x, i)
            sigma = batch["schedule"].sigmas[i].expand(B)
            off_t, off_i, on_i = torch.zeros(B, 5, dtype=torch.bool), torch.zeros(B, dtype=torch.bool), torch.ones(B)
            kw = {"cond_latents": batch["cond_latents"]}
            vu = m(batch["input_ids"], x, sigma, text_mask=off_t, cond_mask=off_i, **kw)
            vt = m(batch["input_ids"], x, sigma, text_mask=batch["attention_mask"], cond_mask=off_i, **kw)
            vf = m(batch["input_ids"], x, sigma, text_mask=batch["attention_mask"], cond_mask=on_i.bool(), **kw)
            if 0.3 <= sigma[0] <= 0.95:
                ref = vu + 3.0 * (vt - vu) + 1.5 * (vf - vt)
            else:
                ref = vf
            torch.testing.assert_close(v, ref, rtol=1e-5, atol=1e-5)


def _rollout(adapter, m, batch, start):
    gens = [torch.Generator().manual_seed(s) for s in range(B)]
    return rollout(
        adapter,
        m,
        batch,
        latent_shape=SHAPE,
        num_inference_steps=STEPS,
        window_size=WINDOW,
        generators=gens,
        window_start_range=(start, start),
    )


@pytest.mark.parametrize("cond", [True, False])
def test_rollout_and_training_recompute_bitwise(cond):
    adapter, m = _adapter(), _model().eval()
    batch = _batch(cond=cond)
    start = 1
    res = _rollout(adapter, m, batch, start)
    assert res.latents.shape == (B, WINDOW + 1, *SHAPE) and torch.isfinite(res.log_probs).all()
    train_batch = {**batch, "schedule": res.schedule}
    m.train()
    for j in range(WINDOW):
        lp, _, _, _ = adapter.forward_and_sample_previous_step(
            m,
            train_batch,
            res.latents[:, j],
            res.step_indices[:, j],
            prev_sample=res.latents[:, j + 1],
            noise_level=torch.full((B,), adapter.noise_level),
        )
        assert lp.requires_grad
        assert torch.equal(lp.detach(), res.log_probs[:, j]), j
    again = _rollout(adapter, m.eval(), batch, start)
    assert torch.equal(again.latents, res.latents)


def test_trainer_runs_on_mot_with_lora():
    adapter = _adapter()
    m = _model()
    m.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj_moe_gen", "v_proj_moe_gen", "llm2vae"]))
    batch = _batch(b=2)
    cfg = GRPOConfig(
        num_inference_steps=STEPS, window_size=WINDOW, window_start_range=(1, 1), group_size=2, kl_coef=0.1, lr=1e-2
    )
    trainer = FlowGRPOTrainer(adapter, m, LatentMeanReward(0.5), cfg, latent_shape=SHAPE)
    first = trainer.train_step(["p0", "p1"], batch)
    assert first["ratio_mean"] == 1.0 and first["clip_fraction"] == 0.0 and first["kl"] == 0.0
    second = trainer.train_step(["p0", "p1"], batch)
    assert second["kl"] > 0.0
