"""The contract between the RL loop and an algorithm: one ``Algorithm`` subclass per module under ``algorithms/``,
its instance ``ALGORITHM`` (``runtime.rl.config.algorithm`` returns it). The loop, the trainers and the run's
set-up call an algorithm only through the methods below: every hook has a default, so an algorithm states what it
changes and nothing else, and the loop never asks what an algorithm happens to define.

Why a class with defaults, not optional module attributes: the loop used to probe eight optional names
(``getattr``/``hasattr``), so a misspelt hook silently fell back to Flow-GRPO's behaviour; here a hook the loop calls
always exists, a subclass that overrides it is visible in one place, and the signatures are checked by the type
checker.

What an algorithm decides, in the order of an iteration:

* its config: ``Settings`` (the frozen dataclass of the section named ``name``), ``rules`` (its key rules),
  ``check(config)`` (what types and ranges do not say) and ``conventions(settings)`` (the log's line naming the
  conventions in use and whose they are: docs/flowgrpo.md, "Conventions");
* what it samples: ``data`` (``"prompts"`` rolled out under the policy, or offline ``"pairs"``); for prompts the
  rollout's SDE ``window(settings, num_steps, step)``, the ``window_keys`` that place it (empty: none does; a
  pipeline with two experts trains only an algorithm whose settings place it: ``runtime/rl/experts.py``) and the
  ``initial_noise`` (None: each sample its own);
* its rewards' use: ``advantages(settings, rewards, group_ids)`` over the global batch;
* which steps it trains: ``trains_on`` (``"steps"``: the rollout's window steps, ``train_positions`` choosing a
  subset per sample; ``"clean_samples"``: the forward process on the rollout's final samples; ``"pairs"``: the
  preference pairs) and ``needs_old_mean`` (the loop keeps the pre-update step means); ``needs_sequence_ratio``
  (GSPO: the loop computes each sample's mean log-ratio over its trained steps before an epoch's backward passes);
* what it compares with a frozen reference: ``needs_reference``, ``teacher_path`` (another checkpoint's weights: a
  distillation teacher) and ``reference_terms`` (the step means, or the velocities);
* its loss: ``step_objective`` (``"steps"``), ``forward_objective`` (``"clean_samples"``), ``pair_objective``
  (``"pairs"``): the loss of one micro-batch before the share scaling, and its statistics;
* its metrics: ``iteration_metrics`` (added to the iteration's line), ``gap_alarm`` (the log-prob gap alarm's
  threshold; infinite when it computes no log-prob);
* its checkpoint state: ``state_dict`` / ``load_state_dict`` (JSON data saved with every checkpoint; the built-in
  algorithms carry none: every choice they make is a function of ``(model.seed, iteration, sample)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:  # the config part is read before torch is imported (runtime.rl --help)
    import torch

    from runtime.config.sections import KeyRules

Data = Literal["prompts", "pairs"]
TrainsOn = Literal["steps", "clean_samples", "pairs"]
ReferenceTerms = Literal["mean", "velocity"]
Gaussian = tuple["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"]

__all__ = ["Algorithm", "Data", "Gaussian", "ReferenceTerms", "TrainsOn"]


class Algorithm:
    """The hooks the loop calls (module docstring); subclasses set the class attributes and override what differs."""

    name: ClassVar[str]
    Settings: ClassVar[type]
    rules: ClassVar[KeyRules]
    data: ClassVar[Data] = "prompts"
    trains_on: ClassVar[TrainsOn] = "steps"
    needs_old_mean: ClassVar[bool] = False
    window_keys: ClassVar[tuple[str, ...]] = ()  # the settings that place the SDE window (size first)

    # ------------------------------------------------------------------------------------------------ config
    def check(self, config: Any) -> None:  # the run's runtime.rl.config.RLConfig (config imports this module)
        """Refuse what the section's types and ranges do not (every problem in one ``ConfigError``)."""

    def conventions(self, settings: Any) -> str:
        """The conventions in use, named with whose they are, for the run's log."""
        raise NotImplementedError(f"{type(self).__name__}.conventions")

    def needs_reference(self, settings: Any) -> bool:
        """Whether the run builds the frozen reference policy: when a KL term is on."""
        return settings.kl_coef > 0

    def teacher_path(self, settings: Any) -> str | None:
        """The pipeline directory (the policy's model type) the frozen reference is loaded from, or None: the
        policy's own starting weights (the top-level ``reference``). A distillation teacher is a reference with other
        weights, so it takes the reference's place and path (DiffusionOPD)."""
        return None

    def reference_terms(self, settings: Any) -> ReferenceTerms:
        """What ``step_objective``'s ``kl_terms`` compare: ``"mean"``, the step Gaussians' means ``(mean, ref_mean,
        std_dev_t, sqrt_dt)``; ``"velocity"``, the predicted velocities at the step's latents ``(v, ref_v, std_dev_t,
        sqrt_dt)`` (a flow-matching MSE; the loop takes the step from the same ``v``: one forward)."""
        return "mean"

    # ---------------------------------------------------------------------------------------- what it samples
    def window(self, settings: Any, num_steps: int, step: int) -> tuple[int, tuple[int, int]]:
        """(SDE window size, inclusive range of window starts) of iteration ``step`` over ``num_steps`` steps."""
        raise NotImplementedError(f"{type(self).__name__}.window")

    def initial_noise(
        self, settings: Any, seed: int, step: int, first: int, count: int, latent_shape: Sequence[int]
    ) -> torch.Tensor | None:
        """The rollout's starting noise of global samples ``first ..`` or None (each sample draws its own)."""
        return None

    def advantages(self, settings: Any, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """Per-sample training weights of the GLOBAL batch's rewards (every replica's samples)."""
        raise NotImplementedError(f"{type(self).__name__}.advantages")

    # ------------------------------------------------------------------------------------- which steps it trains
    def train_positions(
        self, settings: Any, window_size: int, seed: int, step: int, first: int, count: int
    ) -> torch.Tensor | None:
        """``[count, K]`` window positions global samples ``first ..`` train on, or None: all, in order."""
        return None

    def needs_sequence_ratio(self, settings: Any) -> bool:
        """Whether ``step_objective`` takes ``seq_log_ratio``: each sample's mean of ``log p - log p_old`` over its
        trained steps under the epoch's weights (a no-grad pass before the epoch's backward passes: every step of a
        sample must be known before the first step's loss)."""
        return False

    # ------------------------------------------------------------------------------------------------ its loss
    def step_objective(
        self,
        settings: Any,
        log_prob: torch.Tensor,
        old_log_prob: torch.Tensor,
        advantage: torch.Tensor,
        kl_terms: Gaussian | None,
        gaussian: Gaussian | None = None,
        seq_log_ratio: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        kl_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``trains_on == "steps"``: one window step's loss. ``kl_terms``: ``(mean, ref_mean, std_dev_t,
        sqrt_dt)`` when ``needs_reference`` (the velocities for ``reference_terms == "velocity"``); ``gaussian``:
        ``(mean, old_mean, std_dev_t, sqrt_dt)`` when ``needs_old_mean``; ``seq_log_ratio`` (``[B]``, passed only when
        ``needs_sequence_ratio``). ``weights`` / ``kl_weights`` (``[B]``, detached; None: unweighted): rollout
        correction's per-sample weights of the policy term and of the KL or distillation term, each multiplying a
        sample's term before the objective's batch mean, so that what the objective computes over the micro-batch
        (a shared scale) is computed once over all its rows (``runtime/rl/rollout_correction.py``)."""
        raise NotImplementedError(f"{type(self).__name__} trains no rollout steps")

    def forward_objective(
        self,
        settings: Any,
        v: torch.Tensor,
        v_old: torch.Tensor,
        target: torch.Tensor,
        weights: torch.Tensor,
        t: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``trains_on == "clean_samples"``: the loss on the forward process's ``x_t`` (times ``t``) of the
        rollout's samples."""
        raise NotImplementedError(f"{type(self).__name__} trains no forward process")

    def pair_objective(
        self,
        settings: Any,
        v_w: torch.Tensor,
        v_l: torch.Tensor,
        v_w_ref: torch.Tensor,
        v_l_ref: torch.Tensor,
        target_w: torch.Tensor,
        target_l: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``trains_on == "pairs"``: the loss of the chosen and rejected samples' velocities against a reference."""
        raise NotImplementedError(f"{type(self).__name__} trains no preference pairs")

    # ----------------------------------------------------------------------------------------------- metrics
    def iteration_metrics(self, settings: Any, num_steps: int, step: int) -> dict[str, Any]:
        """The algorithm's own entries of iteration ``step``'s metrics."""
        return {}

    def gap_alarm(self, settings: Any) -> float:
        """The rollout-vs-training log-prob gap above which the loop raises its alarm (inf: no log-probs)."""
        return math.inf

    # -------------------------------------------------------------------------------------- checkpoint state
    def state_dict(self) -> dict[str, Any]:
        """JSON data the algorithm carries between iterations (saved with every checkpoint)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s data on resume; an algorithm without state refuses any."""
        if state:
            raise ValueError(f"{self.name}: carries no checkpoint state, found {sorted(state)}")
