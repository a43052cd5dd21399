"""The transformers ``PreTrainedModel`` shell around a generated diffusers transformer, and its config bridge.

A generated DiT module ends with two small classes written by the ``dit/training_shell`` template::

    class WanTransformer3DModelConfig(PatchgenDiTConfig):          # a transformers config
        model_type = "wan"
        diffusers_class = WanTransformer3DModel                     # this module's (patched) diffusers class
        default_condition_model_type = "wan"

    class WanTransformer3DModelForTraining(PatchgenDiTShell, WanTransformer3DModel, DiTPreTrainedModel):
        config_class = WanTransformer3DModelConfig

so the registry, FSDP and checkpoint code treat it like any transformers model (``isinstance(m, PreTrainedModel)``,
``m.config.model_type``, ``_no_split_modules``) while the module computes exactly what the diffusers class computes.

Why three bases in that order:

* ``PatchgenDiTShell`` first: its ``config`` / ``_internal_dict`` properties and its ``save_pretrained`` /
  ``from_pretrained`` must win over both libraries' versions.
* the diffusers class before ``PreTrainedModel``: both define class attributes with the same names
  (``_no_split_modules``, ``_keep_in_fp32_modules``, ``_keys_to_ignore_on_load_unexpected``, ``dtype``, the
  gradient-checkpointing plumbing...) and the diffusers values are the ones that describe this module.
* ``DiTPreTrainedModel`` last: diffusers' ``ModelMixin.__init__`` calls ``super().__init__()`` with no arguments;
  in this MRO that call lands in ``DiTPreTrainedModel.__init__``, which hands ``PreTrainedModel.__init__`` the
  config the shell stored before anything else ran. ``nn.Module.__init__`` thus runs exactly once.

One source of truth for the configuration: the transformers config. diffusers code reads ``self.config.<name>``
(an attribute of the transformers config) and writes ``self._internal_dict`` (``register_to_config``), which the
shell resolves into that same config.
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any, ClassVar

import diffusers
import torch
from diffusers.configuration_utils import FrozenDict
from transformers import PretrainedConfig, PreTrainedModel

from runtime.diffusion.checkpoint_format import DEFAULT_MAX_SHARD_SIZE, read_config, read_weights, write_model_dir
from runtime.diffusion.pretrained_args import load_options, save_options

__all__ = ["DiTPreTrainedModel", "PatchgenDiTConfig", "PatchgenDiTShell", "diffusers_init_parameters"]

logger = logging.getLogger(__name__)

_CONFIG_SLOT = "_patchgen_config"


def diffusers_init_parameters(cls: type) -> dict[str, Any]:
    """The ``__init__`` parameters of a diffusers model class with their defaults (``inspect.signature``)."""
    init = inspect.unwrap(cls.__init__)  # register_to_config wraps __init__ with functools.wraps
    params = list(inspect.signature(init).parameters.values())[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise TypeError(f"{cls.__name__}.__init__ takes *args/**kwargs; its config cannot be enumerated")
    return {p.name: p.default for p in params}


class PatchgenDiTConfig(PretrainedConfig):
    """Every ``__init__`` parameter of ``diffusers_class`` as an attribute, plus ``condition_model_type`` (registry
    key of the frozen condition model that feeds this transformer) and ``attention_backend`` (a diffusers
    attention backend name, None = diffusers' default). Per-model subclasses set the class attributes."""

    model_type = ""
    diffusers_class: ClassVar[type | None] = None
    default_condition_model_type: ClassVar[str] = ""

    def __post_init__(self, **kwargs: Any) -> None:
        if self.diffusers_class is None:
            raise TypeError(f"{type(self).__name__} has no diffusers_class; use a generated model's config class")
        for name, default in diffusers_init_parameters(self.diffusers_class).items():
            value = kwargs.pop(name, default)
            if value is inspect.Parameter.empty:
                raise TypeError(f"{type(self).__name__}: the diffusers parameter {name!r} has no default; pass it")
            setattr(self, name, value)
        self.condition_model_type = kwargs.pop("condition_model_type", None) or self.default_condition_model_type
        self.attention_backend = kwargs.pop("attention_backend", None)
        super().__post_init__(**kwargs)

    def to_diffuser_dict(self) -> dict[str, Any]:
        """Exactly the parameters of the diffusers ``__init__`` signature, with this config's values."""
        return {name: getattr(self, name) for name in diffusers_init_parameters(self.diffusers_class)}

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.pop("dtype", None)
        out["_class_name"] = self.diffusers_class.__name__
        out["_diffusers_version"] = diffusers.__version__
        return out

    def diffusers_config_json(self) -> dict[str, Any]:
        """What ``config.json`` of a diffusers model directory holds: the init parameters plus the class metadata."""
        return {
            **self.to_diffuser_dict(),
            "_class_name": self.diffusers_class.__name__,
            "_diffusers_version": diffusers.__version__,
        }


class DiTPreTrainedModel(PreTrainedModel):
    """The ``PreTrainedModel`` base of a DiT shell (see the module docstring for why it comes last)."""

    config_class = PatchgenDiTConfig
    base_model_prefix = ""
    main_input_name = "hidden_states"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        PreTrainedModel.__init__(self, self.__dict__[_CONFIG_SLOT])


class PatchgenDiTShell:
    """Config bridge, diffusers-format save/load and transformers-style gradient checkpointing for a DiT."""

    config_class: ClassVar[type[PatchgenDiTConfig]]

    def __init__(self, config: PatchgenDiTConfig) -> None:
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}")
        # Stored before any base __init__ runs: register_to_config (first thing of the diffusers __init__) writes
        # through the _internal_dict property into it, and DiTPreTrainedModel.__init__ hands it to transformers.
        self.__dict__[_CONFIG_SLOT] = config
        config.diffusers_class.__init__(self, **config.to_diffuser_dict())
        if config.attention_backend:
            self.set_attention_backend(config.attention_backend)

    # ---- one configuration for both libraries ------------------------------------------------------------------

    @property
    def config(self) -> PatchgenDiTConfig:
        return self.__dict__[_CONFIG_SLOT]

    @config.setter
    def config(self, value: PatchgenDiTConfig) -> None:
        self.__dict__[_CONFIG_SLOT] = value

    @property
    def _internal_dict(self) -> FrozenDict:
        return FrozenDict(self.config.to_diffuser_dict())

    @_internal_dict.setter
    def _internal_dict(self, value: Any) -> None:
        for key, item in dict(value).items():
            if not key.startswith("_"):  # register_to_config's bookkeeping (_use_default_values) is not config
                setattr(self.config, key, item)

    # ---- gradient checkpointing with the transformers names, diffusers' mechanism --------------------------------

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        """Per-block non-reentrant checkpointing through the diffusers blocks' own hook."""
        kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}

        def checkpoint_block(block: torch.nn.Module, *args: Any, **block_kwargs: Any) -> Any:
            # block_kwargs: what a block takes by keyword (the split of dit/pass_split: Sana)
            return torch.utils.checkpoint.checkpoint(block.__call__, *args, **kwargs, **block_kwargs)

        self.enable_gradient_checkpointing(checkpoint_block)

    def gradient_checkpointing_disable(self) -> None:
        self.disable_gradient_checkpointing()

    # ---- pure diffusers checkpoints -----------------------------------------------------------------------------

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *,
        state_dict: dict[str, torch.Tensor] | None = None,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        variant: str | None = None,
        is_main_process: bool = True,
        safe_serialization: bool = True,
        **others: Any,
    ) -> None:
        """A directory plain diffusers loads (``<Class>.from_pretrained``, or as a pipeline's ``transformer``):
        ``config.json`` with only the diffusers ``__init__`` parameters + ``_class_name`` + ``_diffusers_version``,
        safetensors with the upstream key names, sharded above ``max_shard_size``, named for ``variant`` as diffusers
        names them. ``state_dict`` overrides the module's own (e.g. a full state dict gathered from FSDP shards).
        The other arguments of diffusers' ``ModelMixin.save_pretrained`` are honoured or refused (pretrained_args)."""
        options = save_options(
            type(self).__name__,
            variant=variant,
            is_main_process=is_main_process,
            safe_serialization=safe_serialization,
            **others,
        )
        if not options.is_main_process:
            return
        weights = self.state_dict() if state_dict is None else state_dict
        write_model_dir(save_directory, self.config.diffusers_config_json(), weights, max_shard_size, options.variant)

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any
    ) -> PatchgenDiTShell | tuple[PatchgenDiTShell, dict[str, list]]:
        """Load any standard diffusers model directory (single or sharded safetensors, a ``variant``), e.g. a
        pipeline's ``transformer/`` folder (``subfolder="transformer"``), in ``dtype`` / ``torch_dtype``. Every other
        loading argument diffusers documents is honoured or refused (``runtime/diffusion/pretrained_args.py``); the
        remaining keyword arguments set project-only config keys such as ``condition_model_type`` or
        ``attention_backend``. Returns the model in eval mode, as diffusers does, and with
        ``output_loading_info=True`` also diffusers' loading info: checkpoint keys the model does not have are
        reported there (and logged), as upstream does; missing keys are an error. Our trainer refuses both."""
        diffusers_cls = cls.config_class.diffusers_class
        known = diffusers_init_parameters(diffusers_cls)
        project_keys = {"condition_model_type", "attention_backend", *known}
        options, config_overrides = load_options(cls.__name__, kwargs, project_keys)
        directory = Path(pretrained_model_name_or_path) / (options.subfolder or "")
        raw = read_config(directory, diffusers_cls.__name__)
        unknown = sorted(set(raw) - set(known))
        if unknown:
            logger.warning("%s: ignoring config keys %s unknown to %s", directory, unknown, diffusers_cls.__name__)
        config = cls.config_class(**{k: v for k, v in raw.items() if k in known}, **config_overrides)
        dtype = options.dtype or torch.get_default_dtype()
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(config)
        finally:
            torch.set_default_dtype(previous)
        info = _load_weights(model, read_weights(directory, options.variant), directory)
        _keep_in_fp32(model, dtype)
        model.eval()
        return (model, info) if options.output_loading_info else model


def _load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], directory: Path) -> dict[str, list]:
    """Load ``state`` into ``model``: missing keys are an error (they would stay random), unexpected ones are logged
    and returned, as diffusers' own loader treats them."""
    ignore = tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    unexpected = sorted(k for k in set(state) - set(model.state_dict()) if not any(p in k for p in ignore))
    state = {k: v for k, v in state.items() if k not in unexpected and not any(p in k for p in ignore)}
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys:
        raise ValueError(
            f"{directory}: checkpoint does not match {type(model).__name__}: {len(result.missing_keys)} missing "
            f"weight(s), e.g. {sorted(result.missing_keys)[:5]}"
        )
    if unexpected:
        logger.warning(
            "%s: %d checkpoint weights %s is not using: %s",
            directory,
            len(unexpected),
            type(model).__name__,
            unexpected[:5],
        )
    return {"missing_keys": [], "unexpected_keys": unexpected, "mismatched_keys": [], "error_msgs": []}


def _keep_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """diffusers' rule: parameters under a module named in ``_keep_in_fp32_modules`` stay fp32 in fp16/bf16 models."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    keep = (keep,) if isinstance(keep, str) else tuple(keep)  # a bare string names one module, not its characters
    if dtype not in (torch.float16, torch.bfloat16) or not keep:
        return
    for name, param in model.named_parameters():
        if any(k in name.split(".") for k in keep):
            param.data = param.data.float()
