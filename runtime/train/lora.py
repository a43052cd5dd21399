"""LoRA through peft: adapters on the modules whose names match ``target_modules`` (and on the parameters named in
``target_parameters``), everything else frozen; and, under expert parallelism, the experts' adapters laid out so
the grouped expert kernels read ``W + delta`` of their experts. The adapter's weights in the forms checkpoints and
exports need are ``runtime/checkpoint/lora_weights.py``'s.

``target_modules`` follows peft: a list of names matches every module whose qualified name ends with one of them
(``to_q`` matches ``blocks.0.attn1.to_q``; ``attn1.to_q`` only self-attention), a string is a regular expression that
must match the whole qualified name. The adapter is named ``default``; its parameters are
``<module>.lora_A.default.weight`` / ``lora_B``, and the adapted module's own weight moves to
``<module>.base_layer.weight``. ``null`` is the family's default: a DiT's attention projections
(``DIT_TARGET_MODULES``), a text model's attention projections (``TEXT_TARGET_MODULES``; peft's own default for
llama/qwen is ``q_proj, v_proj`` only), and for a vision-language or omni model the same projections of its language
model only, listed by qualified name (an audio encoder has ``q_proj`` too). Not a regular expression: peft 0.21.2
resolves a regex target of a MoE model (its transformers-v5 MoE config conversion) to bare module names, which would
widen it to every tower; a user's regex that peft widens so is refused (``add_lora``).

``target_parameters`` (peft's name) adapts ``nn.Parameter`` s directly through peft's ``ParamWrapper``, e.g. the MoE
experts' fused weights ``mlp.experts.gate_up_proj`` (E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I): a rank-r
adapter per expert. During the wrapper's forward peft registers a parametrization on the experts module, so
``module.gate_up_proj`` reads ``W + scaling * B_e @ A_e``; our expert kernels (``runtime/moe/dispatch.py``) read the
weights through that attribute, so eager, grouped and Triton kernels all see the adapted weights.

Expert parallelism (``shard_expert_adapters``): the experts' adapters are *replicated* over the ep group, not split
by expert. peft stores B of all experts as one (out, r*E) matrix whose column ``j*E + e`` belongs to expert ``e``,
so an expert's columns are strided and no ``Shard`` placement splits them by expert (DCP cannot save the strided
one); and the adapter is small, ``r * (in + out)`` per expert against ``in * out`` for the expert itself (under 2%
at r=16 for Qwen3-30B-A3B's experts), and FSDP shards it at rest like any parameter. Each rank still computes only
its own experts' delta: the factors are DTensors replicated on the ep mesh, the experts' weights DTensors sharded
on it, and DTensor's batched matmul runs on the local experts' slices; in backward DTensor gathers the slices'
gradients over the ep group, so every ep rank holds the whole adapter gradient of its group's tokens, which FSDP
then sums over the expert-data-parallel mesh exactly as it does for the experts themselves.
"""

from __future__ import annotations

import re
import warnings
from typing import TYPE_CHECKING, Any

import torch

from runtime.checkpoint.identity import model_identity
from runtime.checkpoint.lora_weights import ADAPTER
from runtime.config.common import LoraConfig
from runtime.config.errors import ConfigError
from runtime.train.config import RunConfig

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig

__all__ = [
    "DIT_TARGET_MODULES",
    "TEXT_TARGET_MODULES",
    "adapter_identity",
    "add_lora",
    "add_text_lora",
    "lora_identity",
    "peft_lora_config",
    "shard_expert_adapters",
    "text_default_targets",
]

# ``lora.target_modules: null`` on a DiT: the attention projections every diffusers attention block has
DIT_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
# ... on a text, vision-language or omni model: its language model's attention projections
TEXT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def text_default_targets(model: torch.nn.Module, language_model_only: bool) -> tuple[str, ...]:
    """``lora.target_modules: null`` for a transformers model: the attention projections by name, or, for a model
    with vision/audio towers (``language_model_only``), the qualified names of those under the language model
    (``model.get_decoder()``) only."""
    if not language_model_only:
        return TEXT_TARGET_MODULES
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    return tuple(
        name
        for name, _ in model.named_modules()
        if name.startswith(f"{prefix}.") and name.rpartition(".")[2] in TEXT_TARGET_MODULES
    )


def peft_lora_config(settings: LoraConfig, default_targets: tuple[str, ...] | str = DIT_TARGET_MODULES) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    rank = settings.rank
    targets = settings.target_modules if settings.target_modules is not None else default_targets
    return PeftLoraConfig(
        r=rank,
        lora_alpha=settings.alpha if settings.alpha is not None else rank,
        target_modules=targets if isinstance(targets, str) else list(targets),
        target_parameters=settings.target_parameters,
        lora_dropout=settings.dropout,
        bias="none",
        init_lora_weights=True,  # A: Kaiming-uniform from torch's RNG (seeded alike on every rank), B: zeros
    )


def _shown(targets: Any) -> Any:
    return sorted(targets) if isinstance(targets, set | list | tuple) else targets  # peft keeps a list as a set


def add_lora(
    model: torch.nn.Module, settings: LoraConfig, default_targets: tuple[str, ...] | str = DIT_TARGET_MODULES
) -> Any:
    """Inject the adapter into ``model`` in place, freeze everything but the adapter; returns the peft config.
    A target that adapts nothing is a ``ConfigError`` naming its key."""
    from peft import inject_adapter_in_model

    config = peft_lora_config(settings, default_targets)
    targets = _shown(config.target_modules)
    model.requires_grad_(False)
    try:
        with warnings.catch_warnings():  # an unmatched target_parameters entry: refused below, in one line
            warnings.filterwarnings("ignore", message=r"target_parameters=.* no parameter was matched")
            inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as exc:  # peft: no module matched target_modules, or an option the adapter type refuses
        first = " ".join(str(exc).split())[:200]
        if "lora_dropout" in first:
            raise ConfigError(
                f"lora.dropout: {settings.dropout}: peft adapts parameters (lora.target_parameters) without dropout; "
                f"set lora.dropout: 0.0"
            ) from None
        key = "lora.target_modules" if targets else "lora.target_parameters"
        raise ConfigError(f"{key}: {targets if targets else settings.target_parameters!r}: {first}") from None
    if isinstance(targets, str):
        _check_regex_kept(model, targets)
    _check_target_parameters(model, settings.target_parameters or [])
    trained = 0
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
        trained += param.numel() if param.requires_grad else 0
    if not trained:
        raise ConfigError(f"lora.target_modules: {targets!r} adapted no module")
    return config


def _check_regex_kept(model: torch.nn.Module, pattern: str) -> None:
    """Every adapted module matches the ``target_modules`` regex: peft resolves a MoE model's regex to bare module
    names (its transformers-v5 MoE config conversion), which can adapt modules the regex leaves out."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    outside = [
        name
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and not isinstance(module, ParamWrapper) and not re.fullmatch(pattern, name)
    ]
    if outside:
        raise ConfigError(
            f"lora.target_modules: {pattern!r}: peft widened this regular expression to module names and adapted "
            f"{len(outside)} module(s) it does not match (e.g. {outside[0]}); list the modules by name instead"
        )


def _check_target_parameters(model: torch.nn.Module, wanted: list[str]) -> None:
    """peft only warns about a ``target_parameters`` entry that matched nothing; here it is a user error."""
    from peft.tuners.lora.layer import ParamWrapper

    adapted = [
        f"{name.replace('.base_layer', '')}.{module.parameter_name}"
        for name, module in model.named_modules()
        if isinstance(module, ParamWrapper)
    ]
    for entry in wanted:
        if not any(key == entry or key.endswith(f".{entry}") for key in adapted):
            candidates = _parameter_candidates(model)
            hint = (
                f"parameters it could adapt: {', '.join(candidates)}"
                if candidates
                else "the model has no parameter outside its Linear/Embedding/norm layers (MoE experts' fused "
                "weights are what this key is for); adapt its layers with lora.target_modules"
            )
            raise ConfigError(f"lora.target_parameters: {entry!r} matched no parameter of the model; {hint}")


def _parameter_candidates(model: torch.nn.Module, limit: int = 4) -> list[str]:
    """Names (without the layer index) of the matrices held directly by modules that are not Linear/Embedding:
    what ``target_parameters`` is for."""
    names: set[str] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if param.dim() >= 2:
                qualified = f"{module_name}.{param_name}" if module_name else param_name
                names.add(re.split(r"\.\d+\.", qualified)[-1])
    return sorted(names)[:limit]


def add_text_lora(model: torch.nn.Module, config: RunConfig, state: Any) -> Any:
    """The adapter of a text, vision-language or omni model (the trainer's text job): after ``apply_ep`` (the
    experts' adapters see their sharded weights) and before FSDP; returns the peft config."""
    from runtime.models.registry import lookup

    torch.manual_seed(config.model.seed)  # the adapter's initial A: identical on every rank, fresh or resumed
    targets = text_default_targets(model, language_model_only=lookup(config.model.type).is_vlm)
    peft_config = add_lora(model, config.lora, targets)
    if state.ep_enabled:
        shard_expert_adapters(model, state.ep_mesh["ep"])
    return peft_config


def lora_identity(model_type: str, model_config: Any, peft_config: Any) -> dict[str, Any]:
    """A LoRA checkpoint's identity: the model's, and the adapter's settings (a resume with another rank, alpha or
    targets is refused, naming ``lora.<key>``)."""
    return model_identity(model_type, model_config, lora=adapter_identity(peft_config))


def adapter_identity(config: PeftLoraConfig) -> dict[str, Any]:
    """What a LoRA checkpoint's meaning depends on (recorded in its identity; a resume must match it): the
    effective rank, alpha and targets of the peft ``config``."""
    return {
        "rank": config.r,
        "alpha": config.lora_alpha,
        "target_modules": _shown(config.target_modules),
        "target_parameters": _shown(config.target_parameters) or None,
    }


def shard_expert_adapters(model: torch.nn.Module, ep_mesh: Any) -> int:
    """Under expert parallelism, after ``apply_ep`` and ``add_lora``: the adapters of expert weights become
    DTensors replicated on the 1-D ``ep_mesh`` (see the module docstring), and the outermost wrapper of each experts
    module is flagged ``ep_sharded`` so that ``apply_fsdp`` shards it, experts and adapter together, over the
    expert-data-parallel mesh (gathered before peft's forward reads them). Returns the number of wrappers."""
    from peft.tuners.lora.layer import ParamWrapper
    from torch.distributed.tensor import DTensor, Replicate

    count, outer = 0, []
    for name, wrapper in model.named_modules():
        if not isinstance(wrapper, ParamWrapper) or not getattr(wrapper.get_base_layer(), "ep_sharded", False):
            continue
        if not isinstance(wrapper.get_param(), DTensor):
            raise ConfigError(
                f"lora.target_parameters: {name.replace('.base_layer', '')}.{wrapper.parameter_name} is not split "
                f"by parallel.ep; under expert parallelism adapt only the experts' sharded weights"
            )
        for factors in (wrapper.lora_A, wrapper.lora_B):
            for linear in factors.values():
                local = linear.weight.detach()
                replicated = DTensor.from_local(local, ep_mesh, [Replicate()], run_check=False)
                linear.weight = torch.nn.Parameter(replicated, requires_grad=linear.weight.requires_grad)
        if not any(name.startswith(f"{o}.") for o in outer):
            outer.append(name)
            wrapper.ep_sharded = True
        count += 1
    return count
