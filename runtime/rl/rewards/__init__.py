"""Rewards of an RL run: each a function of the decoded samples and their prompts, combined by weight.

Contract of one reward (every kind): ``reward(samples, prompts) -> [B]`` float values, one per sample, computed from
that sample alone (never from its batch); ``samples`` are pixels in [-1, 1], ``(B, 3, H, W)`` images or
``(B, 3, F, H, W)`` videos, ``prompts`` the samples' prompt strings. A reward that raises (``sys.exit`` included),
returns the wrong count or a non-finite value fails the iteration with one line naming the reward (``RewardError``,
exit 2): nothing is trained on it. A reward that raises ``KeyboardInterrupt`` interrupts the run (one line naming it,
exit code 130).

Config (``rewards:``, a list; each item names exactly one kind, plus ``weight`` (default 1.0) and ``name``)::

    - {callable: "my_pkg.rewards:score", kwargs: {...}}   # a function, or a class built once with kwargs
    - {http: "http://127.0.0.1:8000/score", timeout: 30}  # runtime/rl/rewards/http.py (the JSON contract)
    - {clip: checkpoints/clip}                            # runtime/rl/rewards/models.py: CLIP image-text score
    - {pickscore: checkpoints/pickscore, processor: ...}  # a preference score (CLIP with a learned head)
    - {aesthetic: checkpoints/clip-l14, head: sac+logos+ava1-l14-linearMSE.pth}  # rewards/aesthetic.py: LAION's
    - {vlm_judge: checkpoints/qwen2.5-vl, question: "..."}  # rewards/vlm.py: p(yes) of a local VLM's answer
    - {ocr: checkpoints/qwen2.5-vl}                       # rewards/vlm.py: flow_grpo's OCR accuracy, a VLM reading
    - {jpeg_compressibility: true, scale: 0.002}          # rewards/jpeg.py: -scale * JPEG kB (and incompressibility)

The combined reward is ``sum_k weight_k * reward_k``; the metrics keep each reward's mean and std too.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.config.errors import ConfigError
from runtime.rl.reward_entries import KINDS, default_name, reward_entry_problems

__all__ = ["KINDS", "Reward", "RewardError", "RewardMix", "build_rewards", "reward_names"]


class RewardError(ConfigError):
    """A reward failed (raised, timed out, answered malformed data or non-finite values); names the reward."""


@dataclass(frozen=True)
class Reward:
    name: str
    weight: float
    fn: Callable[[torch.Tensor, Sequence[str]], Any] = field(repr=False)

    def __call__(self, samples: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        try:
            values = self.fn(samples, list(prompts))
        except RewardError as exc:
            raise RewardError(f"reward {self.name!r}: {exc}") from None
        except KeyboardInterrupt:  # an interrupt stays one (exit 130 through runtime.rl), naming where it came
            raise KeyboardInterrupt(f"reward {self.name!r} raised KeyboardInterrupt") from None
        except (Exception, SystemExit) as exc:  # a user's reward: any failure is this reward's, in one line
            raise RewardError(f"reward {self.name!r} failed: {_described(exc)}") from None
        try:
            out = torch.as_tensor(values, dtype=torch.float32).detach().cpu().reshape(-1)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise RewardError(f"reward {self.name!r} returned {type(values).__name__}, not numbers: {exc}") from None
        if out.numel() != len(prompts):
            raise RewardError(f"reward {self.name!r} returned {out.numel()} values for {len(prompts)} samples")
        if not torch.isfinite(out).all():
            raise RewardError(f"reward {self.name!r} returned non-finite values: {out.tolist()[:8]}")
        return out


@dataclass(frozen=True)
class RewardMix:
    rewards: tuple[Reward, ...]

    def __call__(self, samples: torch.Tensor, prompts: Sequence[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(combined ``sum weight * reward`` [B], each reward's values by name)."""
        each = {r.name: r(samples, prompts) for r in self.rewards}
        combined = sum(r.weight * each[r.name] for r in self.rewards)
        return combined.float(), each

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def unreachable(self) -> str | None:
        """The first reward whose server cannot be reached (the rewards with a ``probe``: HTTP), as a one-line
        error naming ``rewards[i]``; None when every server answers a connection."""
        for index, reward in enumerate(self.rewards):
            problem = reward.fn.probe() if hasattr(reward.fn, "probe") else None
            if problem:
                url = getattr(reward.fn, "url", "")
                return f"rewards[{index}].http: {url} {problem}; start the reward server before the run"
        return None


_DOTTED = re.compile(r"(?!\d)\w+(\.(?!\d)\w+)*")  # identifiers joined by dots
_FORM = "expected package.module:function (an importable module by its dotted name, not a file path)"


def import_target(target: str, key: str) -> Any:
    """``module:attr`` (or ``module.attr``) imported; a one-line ``ConfigError`` naming ``key`` otherwise: a target
    that is no dotted module name (a file path, a relative import), a module that fails to import (whatever it
    raises, ``sys.exit`` included: the config is what names it), a missing attribute."""
    module_name, sep, attr = target.partition(":")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    if not _DOTTED.fullmatch(module_name) or not _DOTTED.fullmatch(attr) or "." in attr:
        raise ConfigError(f"{key}: {target!r} is not an import path; {_FORM}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import {module_name!r}: {_one_line(exc)}") from None
    except (Exception, SystemExit) as exc:  # the module's own code failed while it was imported
        raise ConfigError(f"{key}: importing {module_name!r} failed: {_described(exc)}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{key}: {module_name!r} has no {attr!r}") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def _described(exc: BaseException) -> str:
    """``exc`` as one line: ``SystemExit(0)`` says it called ``sys.exit``, which ends no run here."""
    if isinstance(exc, SystemExit):
        return f"it raised SystemExit({exc.code!r}) (sys.exit); a reward returns its values instead"
    return f"{type(exc).__name__}: {_one_line(exc)}"


def _build_one(index: int, spec: dict[str, Any]) -> Reward:
    key = f"rewards[{index}]"
    problems = reward_entry_problems(index, spec)  # the config check found them already; a direct caller too
    if problems:
        raise ConfigError(*problems)
    kind = next(k for k in KINDS if k in spec)
    target, weight = spec[kind], spec.get("weight", 1.0)
    name = spec.get("name", default_name(index, kind))
    if kind == "callable":
        fn = import_target(target, f"{key}.callable")
        kwargs = spec.get("kwargs", {})
        if not isinstance(kwargs, dict):
            raise ConfigError(f"{key}.kwargs: expected a mapping, found {kwargs!r}")
        if isinstance(fn, type):
            try:
                fn = fn(**kwargs)
            except (Exception, SystemExit) as exc:
                raise ConfigError(f"{key}.kwargs: {target}({kwargs!r}) failed: {_described(exc)}") from None
        elif kwargs:
            raise ConfigError(f"{key}.kwargs: {target} is a function; kwargs build a class")
        if not callable(fn):
            raise ConfigError(f"{key}.callable: {target} is not callable")
    elif kind == "http":
        from runtime.rl.rewards.http import HttpReward

        fn = HttpReward.from_spec(target, spec, key)
    elif kind in ("jpeg_compressibility", "jpeg_incompressibility"):
        from runtime.rl.rewards.jpeg import JpegSizeReward

        fn = JpegSizeReward(kind, spec.get("scale"))
    else:
        fn = _model_reward(kind, target, spec, key)
    return Reward(name, float(weight), fn)


def _model_reward(kind: str, path: str, spec: dict[str, Any], key: str) -> Any:
    """The checkpoint-based reward of a checked entry (``clip``, ``pickscore``, ``aesthetic``, ``vlm_judge``,
    ``ocr``); a ``ConfigError`` naming ``key`` when it cannot load."""
    batch_size = spec.get("batch_size", 32 if kind in ("clip", "pickscore", "aesthetic") else 8)
    try:
        if kind == "aesthetic":
            from runtime.rl.rewards.aesthetic import AestheticReward

            return AestheticReward.from_pretrained(path, spec["head"], batch_size)
        if kind == "vlm_judge":
            from runtime.rl.rewards.vlm import VlmJudgeReward

            return VlmJudgeReward.from_pretrained(path, spec.get("question"), batch_size)
        if kind == "ocr":
            from runtime.rl.rewards.vlm import VlmOcrReward

            tokens = spec.get("max_new_tokens", 32)
            return VlmOcrReward.from_pretrained(path, spec.get("question"), batch_size, max_new_tokens=tokens)
        from runtime.rl.rewards.models import ClipReward

        return ClipReward.from_pretrained(path, kind, spec.get("processor"), batch_size)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        what = {"vlm_judge": "a VLM", "ocr": "a VLM", "aesthetic": "a CLIP + aesthetic head"}.get(kind, "a CLIP")
        raise ConfigError(f"{key}.{kind}: cannot load {what} checkpoint from {path}: {_one_line(exc)}") from None


def reward_names(specs: Sequence[dict[str, Any]]) -> list[str]:
    """The names of a (validated) rewards list, in order: ``name``, or the kind and the index."""
    return [spec.get("name") or default_name(i, next(k for k in KINDS if k in spec)) for i, spec in enumerate(specs)]


def build_rewards(specs: Sequence[dict[str, Any]]) -> RewardMix:
    """The reward mix of the config's ``rewards`` list (``ConfigError`` naming ``rewards[i]...`` on a bad entry)."""
    rewards = tuple(_build_one(i, dict(spec)) for i, spec in enumerate(specs))
    names = [r.name for r in rewards]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise ConfigError(f"rewards: two rewards are named {duplicate!r}; give each a name")
    return RewardMix(rewards)
