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

from runtime.flowgrpo.rollout import RolloutResult
from runtime.flowgrpo.scheduler import FlowMatchSchedule

__all__ = [
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
    ):
        if engine is None and model is None:
            raise ValueError("pass a model name or an engine")
        self.model, self._engine, self.engine_kwargs = model, engine, dict(engine_kwargs or {})
        self.height, self.width, self.guidance_scale = height, width, guidance_scale
        self.trajectory_from_output = trajectory_from_output

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
