import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from runtime.rl.adapters.bagel import (
    BAGEL_KEY_MAP,
    BagelMoT,
    BagelMoTFlowGRPO,
    bagel_guidance,
    from_bagel_keys,
    load_bagel_checkpoint,
    save_bagel_checkpoint,
    to_bagel_keys,
)
from runtime.rl.adapters.registry import get_diffusion_model_cls
from runtime.rl.sampling.rollout import rollout
from runtime.rl.sampling.scheduler import make_schedule

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


# ------------------------------------------------------------------ BAGEL's conventions, float64 formulas
# Written from BAGEL's sampler (Bagel.generate_image / _forward_flow and its inferencer's defaults): the timesteps
# t = linspace(1, 0, N + 1) shifted by s t / (1 + (s - 1) t); CFG where interval[0] < t <= interval[1] and the text
# scale > 1; v_text = v_no_text + st (v - v_no_text); v' = v_no_img + si (v_text - v_no_img) when si > 1; "global":
# v' * clamp(|v| / (|v'| + 1e-8), renorm_min, 1) with norms over the whole sample; "channel" the same per token;
# "text_channel": the per-token renorm on v_text before the image step, none after.


def _bagel64(v, v_no_text, v_no_img, t, st, si, interval, renorm_min, kind, p=2):
    v, vnt = v.double(), v_no_text.double()
    vni = v if v_no_img is None else v_no_img.double()
    out = []
    for i in range(v.shape[0]):
        # BAGEL compares its float32 t with the Python bounds as torch does: in float32 (0.4 is not above 0.4f)
        if not (bool(t[i] > interval[0]) and bool(t[i] <= interval[1])) or st <= 1:
            out.append(v[i])
            continue

        def tok(x):  # [C, H, W] -> [tokens, C p p], BAGEL's packed latent tokens
            c, h, w = x.shape
            return x.reshape(c, h // p, p, w // p, p).permute(1, 3, 0, 2, 4).reshape(-1, c * p * p)

        a, b_, c_ = tok(v[i]), tok(vnt[i]), tok(vni[i])
        text = b_ + st * (a - b_)
        if kind == "text_channel":
            scale = a.norm(dim=-1, keepdim=True) / (text.norm(dim=-1, keepdim=True) + 1e-8)
            text = text * scale.clamp(renorm_min, 1)
            g = c_ + si * (text - c_) if si > 1 else text
        else:
            g = c_ + si * (text - c_) if si > 1 else text
            if kind == "global":
                g = g * (a.norm() / (g.norm() + 1e-8)).clamp(renorm_min, 1)
            else:
                g = g * (a.norm(dim=-1, keepdim=True) / (g.norm(dim=-1, keepdim=True) + 1e-8)).clamp(renorm_min, 1)
        c, h, w = v[i].shape
        out.append(g.reshape(h // p, w // p, c, p, p).permute(2, 0, 3, 1, 4).reshape(c, h, w))
    return torch.stack(out)


@pytest.mark.parametrize("steps", [4, 24])
def test_schedule_is_bagels(steps):
    adapter = _adapter()
    sched = adapter.set_timesteps(steps)
    t = torch.linspace(0, 1, steps + 1, dtype=torch.float64).flip(0)
    shifted = 3.0 * t / (1 + 2.0 * t)
    torch.testing.assert_close(sched.sigmas.double(), shifted, rtol=0, atol=1e-7)
    assert sched.sigmas[-1] == 0 and sched.num_steps == steps
    grid = make_schedule({"shift": 3.0}, steps)  # diffusers' own grid: not BAGEL's
    assert (grid.sigmas - sched.sigmas).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["global", "channel", "text_channel"])
@pytest.mark.parametrize("image", [True, False])
@pytest.mark.parametrize("renorm_min", [0.0, 0.9])
def test_guidance_is_bagels(kind, image, renorm_min):
    g = torch.Generator().manual_seed(7)
    v, vnt, vni = (torch.randn(4, 4, 4, 6, generator=g) for _ in range(3))
    vnt[1] *= 4  # a branch far off: the renorm clamps
    t = torch.tensor([0.4, 0.41, 1.0, 0.2])  # the low edge is excluded, the high one included
    kw = dict(text_scale=4.0, image_scale=1.5, interval=(0.4, 1.0), renorm_min=renorm_min, renorm_type=kind)
    got = bagel_guidance(v, vnt, vni if image else None, t, patch_size=2, **kw)
    ref = _bagel64(v, vnt, vni if image else None, t, 4.0, 1.5, (0.4, 1.0), renorm_min, kind)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[0], v[0]) and torch.equal(got[3], v[3]) and not torch.equal(got[1], v[1])


def test_no_guidance_at_text_scale_one_even_with_an_image_scale():
    v, vnt, vni = _vel(0), _vel(1), _vel(2)
    out = bagel_guidance(v, vnt, vni, 0.7, text_scale=1.0, image_scale=2.0, interval=(0.0, 1.0))
    assert torch.equal(out, v)


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
    cls = get_diffusion_model_cls("BagelMoT")
    assert cls is BagelMoTFlowGRPO
    return cls(text_guidance_scale=3.0, image_guidance_scale=1.5, cfg_interval=(0.3, 0.95), **kw)


@pytest.mark.parametrize("cond", [True, False])
def test_adapter_branches_are_bagels(cond):
    """The text-free branch keeps the condition image, the image-free one keeps the text (BAGEL's contexts), each run
    here on its own, combined by the float64 formula."""
    adapter, m = _adapter(), _model().eval()
    batch = {**_batch(cond=cond), "schedule": adapter.set_timesteps(STEPS)}
    x = torch.randn(B, *SHAPE, generator=torch.Generator().manual_seed(3))
    off_t, off_i, on_i = torch.zeros(B, 5, dtype=torch.bool), torch.zeros(B, dtype=torch.bool), torch.ones(B).bool()
    kw = {"cond_latents": batch["cond_latents"]} if cond else {}
    guided = 0
    with torch.no_grad():
        for i in range(STEPS):
            v = adapter.velocity(m, batch, x, i)
            sigma = batch["schedule"].sigmas[i].expand(B)
            text = batch["attention_mask"]
            full = m(batch["input_ids"], x, sigma, text_mask=text, **({**kw, "cond_mask": on_i} if cond else {}))
            no_text = m(batch["input_ids"], x, sigma, text_mask=off_t, **({**kw, "cond_mask": on_i} if cond else {}))
            no_img = m(batch["input_ids"], x, sigma, text_mask=text, cond_mask=off_i, **kw) if cond else None
            ref = _bagel64(full, no_text, no_img, sigma, 3.0, 1.5, (0.3, 0.95), 0.0, "global")
            torch.testing.assert_close(v.double(), ref, rtol=1e-5, atol=1e-5)
            guided += int(0.3 < sigma[0] <= 0.95)
    assert 0 < guided < STEPS  # the interval gates some steps, not all


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
