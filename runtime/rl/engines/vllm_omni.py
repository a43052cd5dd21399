"""A vllm-omni rollout adapter for Flow-GRPO (UNTESTED against a real engine: see below).

``vllm_omni`` cannot be imported with this project's CPU torch build, so it is imported lazily, inside the
functions that need it, never at module import. What is implemented, from vllm-omni's documented offline API
(``from vllm_omni.entrypoints.omni import Omni``; ``Omni(model=...)``; ``omni.generate(prompts, sampling_params)``
returning one output per request with ``output.request_output.images``; ``OmniDiffusionSamplingParams`` from
``vllm_omni.inputs.data`` with ``num_inference_steps`` / ``guidance_scale`` / ``seed`` / ``height`` / ``width``):

* ``build_requests``: our rollout call (prompts, group size, per-sample seeds, steps, guidance, size) -> the list of
  (prompt, sampling-params kwargs) requests, one request per sample so each sample has its own seed (the same
  "trajectory does not depend on the batch" rule the in-process rollout keeps). Pure Python, tested.
* ``parse_outputs``: responses -> one image per sample, in request order, checked (count, missing images). Tested
  on stand-in objects of the documented shape.
* ``VllmOmniRollout``: holds the engine (built lazily), ``generate_images(...)`` -> images, and ``rollout(...)``
  with the in-process rollout's signature.

Weight sync (``plan_weight_sync``, tested statically against the vllm-omni 0.30.0 wheel's sources: it cannot be
imported here). The engine samples with ITS copy of the transformer, so after every update the trained weights must
reach it under its names (``runtime/rl/engines/vllm_omni_names.py``): full fine-tuning sends every parameter under
our (diffusers) names to the engine's ``load_weights``, which fuses q/k/v and renames itself (each name is checked to
land on a parameter of the engine's class first); a LoRA run sends each adapted module's LoRA under the ENGINE's
module name (``to_out.0`` -> ``to_out`` for Wan and Qwen-Image), and a module the engine's LoRA manager cannot bind
(in 0.30.0, Flux's fused ``to_q``/``to_k``/``to_v``: its Flux transformer does not expose the stacked mapping the
manager reads) as its merged weight ``W + scale B A`` through ``load_weights`` instead of binding nothing.
``VllmOmniRollout.sync_weights`` builds the plan from the live engine's transformer class and hands it to
``apply_weights`` (the engine-side call, e.g. a worker extension's ``load_weights`` / ``add_lora``, as verl-omni
does; no documented offline API exists for it).

``VllmOmniRollout`` is also callable with the in-process rollout's signature (``runtime.rl.sampling.rollout.rollout``):
the batch carries the samples' ``prompts``, the generators' initial seeds become the requests' seeds.

What is NOT possible from the documented API, stated plainly: Flow-GRPO's training side needs, per sample, the
window's latents and the rollout log-probs (``RolloutResult``). vllm-omni's documented outputs carry decoded images
only. ``VllmOmniRollout.rollout`` therefore raises ``NotImplementedError`` unless ``trajectory_from_output`` is
given: a function that extracts ``(latents [W+1, ...], step_indices [W], log_probs [W])`` from one raw output, for
a deployment whose pipeline was patched to return them (e.g. via a custom stage output). ``generate_images`` alone
serves reward evaluation and sampling.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.rl.sampling.rollout import RolloutResult
from runtime.rl.sampling.scheduler import FlowMatchSchedule

__all__ = [
    "ENGINE_TRANSFORMERS",
    "WeightSync",
    "plan_weight_sync",
    "VLLM_OMNI_MODULE",
    "vllm_omni_available",
    "OmniRequest",
    "build_requests",
    "parse_outputs",
    "VllmOmniRollout",
]

VLLM_OMNI_MODULE = "vllm_omni"


def vllm_omni_available() -> tuple[bool, str]:
    """``(True, "")`` when ``vllm_omni`` imports, else ``(False, reason)`` (not installed / import error)."""
    if importlib.util.find_spec(VLLM_OMNI_MODULE) is None:
        return False, "vllm_omni is not installed"
    try:
        importlib.import_module("vllm_omni.entrypoints.omni")
    except Exception as exc:  # e.g. a CPU-only torch build: vllm's CUDA extensions fail to load
        return False, f"vllm_omni cannot be imported: {type(exc).__name__}: {exc}"
    return True, ""


@dataclass(frozen=True)
class OmniRequest:
    prompt: str
    sampling: dict[str, Any]  # keyword arguments of OmniDiffusionSamplingParams
    sample_index: int


def build_requests(
    prompts: Sequence[str],
    *,
    group_size: int,
    seeds: Sequence[int],
    num_inference_steps: int,
    guidance_scale: float,
    height: int,
    width: int,
    negative_prompt: str | None = None,
    extra: dict[str, Any] | None = None,
) -> list[OmniRequest]:
    """One request per sample (prompt ``p`` repeated ``group_size`` times, ``[p0, p0, ..., p1, ...]``), sample
    ``i`` seeded with ``seeds[i]``."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    n = len(prompts) * group_size
    if len(seeds) != n:
        raise ValueError(f"need one seed per sample ({n}), got {len(seeds)}")
    requests = []
    for i in range(n):
        sampling = {
            "num_inference_steps": int(num_inference_steps),
            "guidance_scale": float(guidance_scale),
            "seed": int(seeds[i]),
            "height": int(height),
            "width": int(width),
            **(extra or {}),
        }
        if negative_prompt is not None:
            sampling["negative_prompt"] = negative_prompt
        requests.append(OmniRequest(prompts[i // group_size], sampling, i))
    return requests


def parse_outputs(outputs: Sequence[Any], num_requests: int) -> list[Any]:
    """The first image of each output (``output.request_output.images[0]``), in request order."""
    if len(outputs) != num_requests:
        raise ValueError(f"vllm-omni returned {len(outputs)} outputs for {num_requests} requests")
    images = []
    for i, out in enumerate(outputs):
        request_output = getattr(out, "request_output", out)
        imgs = getattr(request_output, "images", None)
        if not imgs:
            raise ValueError(f"output {i} carries no images")
        images.append(imgs[0])
    return images


TrajectoryFn = Callable[[Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

# Our model type -> the vllm-omni 0.30 transformer class that serves it (module, class).
ENGINE_TRANSFORMERS: dict[str, tuple[str, str]] = {
    "flux": ("vllm_omni.diffusion.models.flux.flux_transformer", "FluxTransformer2DModel"),
    "qwenimage": ("vllm_omni.diffusion.models.qwen_image.qwen_image_transformer", "QwenImageTransformer2DModel"),
    "wan": ("vllm_omni.diffusion.models.wan2_2.wan2_2_transformer", "WanTransformer3DModel"),
    "sd3": ("vllm_omni.diffusion.models.sd3.sd3_transformer", "SD3Transformer2DModel"),
}


@dataclass(frozen=True)
class WeightSync:
    """What one sync moves: LoRA tensors under the engine's module names (``<module>.lora_A.weight``, ...) with the
    adapter config whose ``target_modules`` name those modules, and full tensors under our names for the engine's
    ``load_weights`` (every parameter for full fine-tuning; the merged weights of LoRA modules the engine cannot
    bind)."""

    lora: dict[str, torch.Tensor]
    lora_config: dict[str, Any] | None
    full: list[tuple[str, torch.Tensor]]
    merged_modules: tuple[str, ...] = ()


def plan_weight_sync(names: Any, state: dict[str, torch.Tensor], peft_config: Any = None) -> WeightSync:
    """The sync of ``state`` (our module's full state dict, peft's names for a LoRA run) into the engine whose
    naming ``names`` (an ``EngineNames``) states. Raises ``ValueError`` naming our parameters the engine does not
    have (nothing is sent then: a partial sync would leave the engine on another policy than the trainer's)."""
    from runtime.checkpoint.lora_weights import ADAPTER, merged_state_dict

    if peft_config is None:
        missing = [k for k in state if names.resolve(names.full_weight(k)[0]) is False]
        if missing:
            raise ValueError(f"the engine has no parameter for {len(missing)} of ours: {', '.join(missing[:4])}")
        return WeightSync({}, None, [(k, v) for k, v in state.items()])
    marker = f".lora_A.{ADAPTER}.weight"
    modules = sorted(k[: -len(marker)] for k in state if k.endswith(marker))
    lora: dict[str, torch.Tensor] = {}
    merged_modules = []
    for module in modules:
        engine = names.lora_module(module)
        if names.resolve(engine, module=True) is True:
            for part in ("lora_A", "lora_B"):
                lora[f"{engine}.{part}.weight"] = state[f"{module}.{part}.{ADAPTER}.weight"]
        else:
            merged_modules.append(module)
    full: list[tuple[str, torch.Tensor]] = []
    if merged_modules:
        merged = merged_state_dict(state, peft_config.lora_alpha / peft_config.r)
        for module in merged_modules:
            name = f"{module}.weight"
            if names.resolve(names.full_weight(name)[0]) is False:
                raise ValueError(f"the engine binds no LoRA on {module} and has no parameter for {name}")
            full.append((name, merged[name]))
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in peft_config.to_dict().items()}
    bound = sorted({m.rsplit(".", 1)[-1] for m in (names.lora_module(x) for x in modules if x not in merged_modules)})
    config["target_modules"] = bound
    return WeightSync(lora, config, full, tuple(merged_modules))


class VllmOmniRollout:
    """Rollout through a vllm-omni engine. ``engine``: an ``Omni`` instance, or None to build
    ``Omni(model=model, **engine_kwargs)`` on first use (the only place ``vllm_omni`` is imported)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        engine: Any = None,
        engine_kwargs: dict[str, Any] | None = None,
        height: int = 512,
        width: int = 512,
        guidance_scale: float = 4.5,
        trajectory_from_output: TrajectoryFn | None = None,
        apply_weights: Callable[[WeightSync], None] | None = None,
    ):
        if engine is None and model is None:
            raise ValueError("pass a model name or an engine")
        self.model, self._engine, self.engine_kwargs = model, engine, dict(engine_kwargs or {})
        self.height, self.width, self.guidance_scale = height, width, guidance_scale
        self.trajectory_from_output = trajectory_from_output
        self.apply_weights = apply_weights

    def sync_weights(self, state: dict[str, torch.Tensor], names: Any, peft_config: Any = None) -> WeightSync:
        """Plan the sync of ``state`` (``plan_weight_sync``) and hand it to ``apply_weights``; returns the plan.
        ``names``: the engine transformer's ``EngineNames`` (``EngineNames.from_sources`` over the installed
        vllm_omni's sources)."""
        plan = plan_weight_sync(names, state, peft_config)
        if self.apply_weights is None:
            raise NotImplementedError(
                "vllm-omni documents no offline call that loads weights into a running engine; pass apply_weights "
                "(e.g. a worker extension's load_weights / add_lora over collective_rpc, as verl-omni does)"
            )
        self.apply_weights(plan)
        return plan

    def __call__(
        self,
        adapter: Any,
        module: Any,
        batch: dict[str, Any],
        *,
        latent_shape: Sequence[int],
        num_inference_steps: int,
        window_size: int,
        generators: Sequence[torch.Generator],
        window_start_range: tuple[int, int] | None = None,
        noise_level: float | None = None,
    ) -> RolloutResult:
        """The in-process rollout's interface (``runtime.rl.sampling.rollout.rollout``): ``batch["prompts"]`` are the
        samples' prompts (one per generator), each generator's initial seed its request's seed; the schedule is the
        adapter's (the engine must sample on it: its trajectory is checked against ``window_size``)."""
        prompts = list(batch.get("prompts") or [])
        if len(prompts) != len(generators):
            raise ValueError(f"batch['prompts'] holds {len(prompts)} prompts for {len(generators)} samples")
        schedule = adapter.set_timesteps(num_inference_steps)
        result = self.rollout(
            prompts,
            group_size=1,
            seeds=[g.initial_seed() for g in generators],
            num_inference_steps=num_inference_steps,
            schedule=schedule,
        )
        if result.step_indices.shape[1] != window_size:
            raise ValueError(f"the engine's trajectories hold {result.step_indices.shape[1]} steps, not {window_size}")
        return result

    @property
    def engine(self) -> Any:
        if self._engine is None:
            ok, reason = vllm_omni_available()
            if not ok:
                raise ImportError(reason)
            from vllm_omni.entrypoints.omni import Omni

            self._engine = Omni(model=self.model, **self.engine_kwargs)
        return self._engine

    @staticmethod
    def _sampling_params(kwargs: dict[str, Any]) -> Any:
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        return OmniDiffusionSamplingParams(**kwargs)

    def _generate(self, requests: list[OmniRequest]) -> list[Any]:
        engine = self.engine
        outputs = []
        for req in requests:  # one call per request: a per-request seed needs its own sampling params
            outputs.extend(engine.generate(req.prompt, self._sampling_params(req.sampling)))
        return outputs

    def _requests(
        self, prompts: Sequence[str], group_size: int, seeds: Sequence[int], num_inference_steps: int
    ) -> list[Any]:
        return build_requests(
            prompts,
            group_size=group_size,
            seeds=seeds,
            num_inference_steps=num_inference_steps,
            guidance_scale=self.guidance_scale,
            height=self.height,
            width=self.width,
        )

    def generate_images(
        self, prompts: Sequence[str], *, group_size: int, seeds: Sequence[int], num_inference_steps: int
    ) -> list[Any]:
        requests = self._requests(prompts, group_size, seeds, num_inference_steps)
        return parse_outputs(self._generate(requests), len(requests))

    def rollout(
        self,
        prompts: Sequence[str],
        *,
        group_size: int,
        seeds: Sequence[int],
        num_inference_steps: int,
        schedule: FlowMatchSchedule,
    ) -> RolloutResult:
        """A ``RolloutResult`` from engine outputs; needs ``trajectory_from_output`` (see the module docstring)."""
        if self.trajectory_from_output is None:
            raise NotImplementedError(
                "vllm-omni's documented outputs carry decoded images only; Flow-GRPO needs each sample's window "
                "latents and rollout log-probs. Pass trajectory_from_output for an engine patched to return them."
            )
        requests = self._requests(prompts, group_size, seeds, num_inference_steps)
        outputs = self._generate(requests)
        if len(outputs) != len(requests):
            raise ValueError(f"vllm-omni returned {len(outputs)} outputs for {len(requests)} requests")
        latents, steps, log_probs = zip(*(self.trajectory_from_output(o) for o in outputs), strict=True)
        latents_t = torch.stack(latents).float()
        steps_t = torch.stack(steps).long()
        return RolloutResult(
            latents=latents_t,
            step_indices=steps_t,
            timesteps=schedule.timesteps[steps_t],
            log_probs=torch.stack(log_probs).float(),
            final_latents=latents_t[:, -1],  # the window's last latent; the engine's own final latent may differ
            schedule=schedule,
        )
