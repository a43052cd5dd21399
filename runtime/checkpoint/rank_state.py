"""Each rank's own part of a checkpoint: the RNG states' tensors (``rank_NNNNN.safetensors``) and the rest as JSON
(``rank_NNNNN.json``: the LR scheduler's state, the RNG states' other fields, the caller's ``extra``).

Nothing is pickled. The files are checked against the completion marker's hashes before they are read, but a hash
proves only that the bytes are the ones the marker lists: a file edited and re-hashed still verifies. So the state is
also checked for the structure this code writes (every key, type and tensor shape) before anything is restored from
it, and whatever does not fit is a ``CheckpointError`` naming the file and the key, never a ``KeyError`` from deep
inside a restore.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from runtime.checkpoint.verify import FORMAT_VERSION, CheckpointError

logger = logging.getLogger(__name__)

_PYTHON_WORDS = len(random.getstate()[1])  # 624 Mersenne Twister words + the position
_NUMPY_KEYS = 624


# ------------------------------------------------------------------------------------------------------------- RNG


def get_rng_state() -> dict[str, Any]:
    """Every generator a training step may draw from, on this process."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) != torch.cuda.device_count():
            logger.warning(
                "checkpoint holds CUDA RNG states of %d devices, this process sees %d; restoring the first ones only",
                len(cuda_states),
                torch.cuda.device_count(),
            )
        for device, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def rng_to_files(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``get_rng_state()``'s dict as (tensors for safetensors, JSON data); ``rng_from_files`` inverts it exactly."""
    version, words, gauss_next = state["python"]
    tensors = {"rng.torch": state["torch"], "rng.python": torch.tensor(words, dtype=torch.int64)}
    data: dict[str, Any] = {"python": {"version": version, "gauss_next": gauss_next}}
    for device, cuda_state in enumerate(state.get("cuda", ())):
        tensors[f"rng.cuda.{device}"] = cuda_state
    data["cuda_devices"] = len(state.get("cuda", ()))
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        tensors["rng.numpy"] = torch.from_numpy(keys.astype("int64"))
        data["numpy"] = {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return tensors, data


def rng_from_files(tensors: dict[str, torch.Tensor], data: dict[str, Any]) -> dict[str, Any]:
    python = data["python"]
    words = tuple(int(w) for w in tensors["rng.python"].tolist())
    state: dict[str, Any] = {"python": (python["version"], words, python["gauss_next"]), "torch": tensors["rng.torch"]}
    if data.get("cuda_devices"):
        state["cuda"] = [tensors[f"rng.cuda.{d}"] for d in range(data["cuda_devices"])]
    if "numpy" in data:
        import numpy as np

        n = data["numpy"]
        keys = tensors["rng.numpy"].numpy().astype(np.uint32)
        state["numpy"] = (n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"])
    return state


# ------------------------------------------------------------------------------------------------------ files


def rank_files(path: Path, rank: int) -> tuple[Path, Path]:
    """This rank's state: RNG tensors (safetensors) and everything else (JSON)."""
    return path / f"rank_{rank:05d}.safetensors", path / f"rank_{rank:05d}.json"


def json_data(value: Any, what: str) -> bytes:
    """``value`` as JSON bytes, refusing anything that would not come back equal (tuples, non-str keys, objects)."""
    try:
        text = json.dumps(value, sort_keys=True)
        same = json.loads(text) == value
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{what} must be JSON data (dicts with str keys, lists, str, numbers, bools, None): {exc}"
        ) from None
    if not same:
        raise TypeError(
            f"{what} must be JSON data (dicts with str keys, lists, str, numbers, bools, None): it would not load "
            f"back equal (tuples become lists, non-str keys strings)"
        )
    return (text + "\n").encode()


def encode_rank_state(
    rank: int, world_size: int, scheduler: Any, rng: dict[str, Any], extra: dict
) -> tuple[bytes, bytes]:
    tensors, rng_data = rng_to_files(rng)
    scheduler_state = None if scheduler is None else scheduler.state_dict()
    data = {
        "format_version": FORMAT_VERSION,
        "rank": rank,
        "world_size": world_size,
        "scheduler": json.loads(json_data(scheduler_state, "the scheduler's state_dict()")),
        "rng": rng_data,
        "extra": extra,
    }
    return save_safetensors({k: v.contiguous() for k, v in tensors.items()}), json_data(data, "the per-rank state")


# ------------------------------------------------------------------------------------------------------ reading


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def structure_problem(saved: Any, template: Any, where: str) -> str | None:
    """Where ``saved`` (JSON data) is not built like ``template``: the same keys, list lengths and kinds of values
    (numbers are numbers, ints and floats alike), or None when it is."""
    if _kind(saved) != _kind(template):
        return f"{where} is a {_kind(saved)}, expected a {_kind(template)}"
    if isinstance(template, dict):
        if set(saved) != set(template):
            odd = sorted(set(saved) ^ set(template))[0]
            return f"{where}.{odd} is {'missing' if odd in template else 'not expected'}"
        for key in sorted(template):
            problem = structure_problem(saved[key], template[key], f"{where}.{key}")
            if problem:
                return problem
    if isinstance(template, list):
        if len(saved) != len(template):
            return f"{where} has {len(saved)} entries, expected {len(template)}"
        for index, (a, b) in enumerate(zip(saved, template, strict=True)):
            problem = structure_problem(a, b, f"{where}[{index}]")
            if problem:
                return problem
    return None


def _rng_problem(tensors: dict[str, torch.Tensor], rng: Any) -> str | None:
    """What does not fit ``rng_to_files``'s layout in the RNG part of a rank state, or None."""
    template = {"python": {"version": 0, "gauss_next": None}, "cuda_devices": 0}
    if not isinstance(rng, dict):
        return f"rng is a {_kind(rng)}, expected an object"
    if "numpy" in rng:
        template["numpy"] = {"kind": "MT19937", "pos": 0, "has_gauss": 0, "cached_gaussian": 0.0}
    python = rng.get("python")
    if isinstance(python, dict) and python.get("gauss_next") is not None:
        template["python"]["gauss_next"] = 0.0
    problem = structure_problem(rng, template, "rng")
    if problem:
        return problem
    if not isinstance(rng["python"]["version"], int) or not isinstance(rng["cuda_devices"], int):
        return "rng.python.version and rng.cuda_devices must be integers"
    if not 0 <= rng["cuda_devices"] <= 1024:
        return f"rng.cuda_devices is {rng['cuda_devices']}"
    expected = {
        "rng.torch": (torch.uint8, (torch.get_rng_state().numel(),)),
        "rng.python": (torch.int64, (_PYTHON_WORDS,)),
        **{f"rng.cuda.{d}": (torch.uint8, None) for d in range(rng["cuda_devices"])},
        **({"rng.numpy": (torch.int64, (_NUMPY_KEYS,))} if "numpy" in rng else {}),
    }
    if set(tensors) != set(expected):
        odd = sorted(set(tensors) ^ set(expected))[0]
        return f"tensor {odd} is {'missing' if odd in expected else 'not expected'}"
    for name, (dtype, shape) in expected.items():
        tensor = tensors[name]
        if tensor.dtype != dtype or tensor.dim() != 1 or (shape is not None and tuple(tensor.shape) != shape):
            want = f"{dtype} of shape {shape}" if shape is not None else f"1-D {dtype}"
            return f"tensor {name} is {tensor.dtype} of shape {tuple(tensor.shape)}, expected {want}"
    return None


def read_rank_state(
    path: Path, rank: int, world_size: int, scheduler: Any | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Rank ``rank``'s (tensors, JSON state) from checkpoint ``path``, saved by ``world_size`` ranks, checked for the
    layout ``encode_rank_state`` writes (the scheduler's against ``scheduler``'s own state); ``CheckpointError``
    naming the file and the first key that does not fit."""
    tensor_file, json_file = rank_files(path, rank)
    try:
        tensors, data = load_safetensors(tensor_file.read_bytes()), json.loads(json_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # verified files that do not parse: written by something else
        raise CheckpointError(f"checkpoint {path}: cannot read the state of rank {rank}: {exc}") from None

    def bad(problem: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {path}: {json_file.name if 'tensor' not in problem else tensor_file.name} does not hold "
            f"the state this runtime writes: {problem}"
        )

    template = {"format_version": 0, "rank": 0, "world_size": 0, "scheduler": None, "rng": {}, "extra": {}}
    if not isinstance(data, dict) or set(data) != set(template):
        found = sorted(data) if isinstance(data, dict) else _kind(data)
        raise bad(f"expected an object with keys {sorted(template)}, found {found}")
    if data["format_version"] != FORMAT_VERSION:
        raise bad(f"format_version is {data['format_version']!r}, expected {FORMAT_VERSION}")
    if data["rank"] != rank or data["world_size"] != world_size:
        raise bad(f"rank {data['rank']!r} of {data['world_size']!r} ranks, expected rank {rank} of {world_size}")
    if not isinstance(data["extra"], dict):
        raise bad(f"extra is a {_kind(data['extra'])}, expected an object")
    problem = _rng_problem(tensors, data["rng"])
    if problem is None and scheduler is not None:
        if data["scheduler"] is None:
            problem = "it holds no scheduler state"
        else:
            current = json.loads(json_data(scheduler.state_dict(), "the scheduler's state_dict()"))
            problem = structure_problem(data["scheduler"], current, "scheduler")
            problem = problem and f"{problem} (saved by another LR scheduler?)"
    if problem:
        raise bad(problem)
    return tensors, data


def saved_extra(path: Path, world_size: int) -> dict[str, Any]:
    """Rank 0's ``extra`` of the (verified) checkpoint ``path`` saved by ``world_size`` ranks, read without a model
    or a process group: what a launcher checks (the step, the learning-rate schedule) before any rank starts."""
    return read_rank_state(path, 0, world_size, None)[1]["extra"]


def restore_rng_state(path: Path, tensors: dict[str, torch.Tensor], rng: dict[str, Any]) -> None:
    """Restore a checked RNG state; values the generators refuse (a mangled word, a wrong version) are one line."""
    try:
        set_rng_state(rng_from_files(tensors, rng))
    except (ValueError, TypeError, RuntimeError, OverflowError) as exc:
        raise CheckpointError(f"checkpoint {path}: its RNG states do not restore: {exc}") from None
