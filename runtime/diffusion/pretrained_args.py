"""The ``from_pretrained`` / ``save_pretrained`` arguments diffusers documents, as the DiT training shell takes them.

diffusers' pipelines call a component's ``from_pretrained`` with their full set of loading arguments (``dtype`` for
a transformers ``PreTrainedModel`` such as the shell, ``torch_dtype`` otherwise, ``variant``, ``device_map``,
``low_cpu_mem_usage``...) and its ``save_pretrained`` with ``variant`` / ``safe_serialization``. The shell must honour
each one or refuse it with one clear error: an argument swallowed as a config override (``dtype`` once was) is a
silent wrong result. Arguments that only change how loading is done, not what is loaded (``low_cpu_mem_usage``,
``disable_mmap``, hub arguments for a local directory), are accepted as no-ops.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["LoadOptions", "SaveOptions", "load_options", "save_options"]

# accepted whatever their value: they change how a local directory is read, never what is read
_NO_EFFECT = (
    "low_cpu_mem_usage",
    "disable_mmap",
    "cache_dir",
    "force_download",
    "local_files_only",
    "proxies",
    "revision",
    "token",
)
# accepted at these values only (what a plain local CPU load means); anything else is refused
_DEFAULTS_ONLY = {
    "device_map": (None, "cpu"),
    "max_memory": (None,),
    "offload_folder": (None,),
    "offload_state_dict": (None, False),
    "quantization_config": (None,),
    "ignore_mismatched_sizes": (False,),
    "use_flashpack": (False,),
    "flashpack_kwargs": (None,),
    "dduf_entries": (None,),
    "parallel_config": (None,),
}


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    dtype: torch.dtype | None = None
    variant: str | None = None
    subfolder: str | None = None
    output_loading_info: bool = False


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    variant: str | None = None
    is_main_process: bool = True


def _refuse(cls_name: str, method: str, name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{cls_name}.{method}: {name}={value!r} is not supported: {why}")


def load_options(cls_name: str, kwargs: dict[str, Any], config_keys: set[str]) -> tuple[LoadOptions, dict[str, Any]]:
    """Split ``kwargs`` into the loading options and the config overrides (keys of ``config_keys``); refuse any
    argument the shell cannot honour."""
    kwargs = dict(kwargs)
    dtypes = {k: kwargs.pop(k) for k in ("dtype", "torch_dtype") if kwargs.get(k) is not None}
    kwargs.pop("dtype", None), kwargs.pop("torch_dtype", None)
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"{cls_name}.from_pretrained: dtype and torch_dtype differ ({dtypes}); pass one")
    dtype = next(iter(dtypes.values()), None)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise _refuse(cls_name, "from_pretrained", "dtype", dtype, "pass a torch.dtype such as torch.bfloat16")
    if kwargs.pop("use_safetensors", None) is False:
        raise _refuse(cls_name, "from_pretrained", "use_safetensors", False, "only safetensors weights are read")
    for name in _NO_EFFECT:
        kwargs.pop(name, None)
    for name, allowed in _DEFAULTS_ONLY.items():
        value = kwargs.pop(name, None if None in allowed else allowed[0])
        if value not in allowed:
            raise _refuse(cls_name, "from_pretrained", name, value, "load on the CPU and move the model with .to()")
    options = LoadOptions(
        dtype=dtype,
        variant=kwargs.pop("variant", None),
        subfolder=kwargs.pop("subfolder", None),
        output_loading_info=bool(kwargs.pop("output_loading_info", False)),
    )
    unknown = sorted(set(kwargs) - config_keys)
    if unknown:
        raise ValueError(
            f"{cls_name}.from_pretrained: unknown argument(s) {unknown}: neither a loading argument nor a config key"
        )
    return options, kwargs


def save_options(
    cls_name: str,
    *,
    is_main_process: bool = True,
    save_function: Any = None,
    safe_serialization: bool = True,
    variant: str | None = None,
    push_to_hub: bool = False,
    use_flashpack: bool = False,
    **unknown: Any,
) -> SaveOptions:
    """The ``save_pretrained`` arguments of diffusers' ``ModelMixin``: honoured or refused, never ignored."""
    for name, value, ok in (
        ("save_function", save_function, save_function is None),
        ("safe_serialization", safe_serialization, safe_serialization),
        ("push_to_hub", push_to_hub, not push_to_hub),
        ("use_flashpack", use_flashpack, not use_flashpack),
    ):
        if not ok:
            raise _refuse(
                cls_name, "save_pretrained", name, value, "the shell writes safetensors to a local directory"
            )
    if unknown:
        raise ValueError(f"{cls_name}.save_pretrained: unknown argument(s) {sorted(unknown)}")
    return SaveOptions(variant=variant, is_main_process=is_main_process)
