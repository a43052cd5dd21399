"""The prompts an RL run samples from, and which ones each data-parallel replica takes at each iteration.

File formats (``data.prompts``): ``.txt``, one prompt a line (blank lines skipped), or ``.jsonl``, one object a line
with a ``"prompt"`` string (other keys ignored). A bad line is one error naming ``file:line``.

``PromptSampler``: every epoch, all ranks compute the same seeded permutation of the prompts (``epoch_permutation``,
every trainer's); an iteration takes ``per_replica * dp_size`` consecutive entries of it and replica ``r`` gets
the ``r``-th slice, so the ranks of one replica (its SP ranks) get the same prompts and ``dp_size`` replicas
together take what one process with ``dp_size * per_replica`` prompts per iteration takes. An epoch's tail shorter
than one iteration is skipped (those prompts come first in no particular epoch: the next permutation decides).
The state is ``(epoch, position)``, the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.data.errors import LineError
from runtime.data.records import MAX_LINE_BYTES, read_records
from runtime.data.sampler import epoch_permutation

__all__ = ["MAX_PROMPT_CHARS", "Prompt", "PromptSampler", "read_prompts"]

MAX_PROMPT_CHARS = 10_000  # longer is not a prompt (and every text encoder truncates far below it)
SUFFIXES = (".txt", ".jsonl")


@dataclass(frozen=True)
class Prompt:
    text: str
    where: str  # file:line


def _checked(text: str, where: str) -> Prompt:
    if len(text) > MAX_PROMPT_CHARS:
        raise LineError(f"a prompt of {len(text)} characters; at most {MAX_PROMPT_CHARS}")
    return Prompt(text, where)


def _from_record(record: Any, where: str) -> Prompt:
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise LineError('expected an object with a "prompt" string, e.g. {"prompt": "a cat on a sofa"}')
    if not record["prompt"].strip():
        raise LineError('"prompt" is empty')
    return _checked(record["prompt"], where)


def _read_text(path: Path) -> list[Prompt]:
    out = []
    with path.open("rb") as f:
        for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            where = f"{path}:{lineno}"
            if len(line) > MAX_LINE_BYTES:
                raise ValueError(f"{where}: a line of more than {MAX_LINE_BYTES} bytes; one prompt a line")
            try:
                text = line.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None
            if text.strip():
                try:
                    out.append(_checked(text, where))
                except LineError as e:
                    raise ValueError(f"{where}: {e}") from None
    return out


def read_prompts(path: str | Path) -> list[Prompt]:
    """Every prompt of ``path`` in file order; ``ValueError`` naming the file (and line) when it cannot be one."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ValueError(f'{path}: expected a .txt (one prompt a line) or .jsonl ({{"prompt": ...}}) file')
    if not path.is_file():
        raise ValueError(f"{path}: {'not a file' if path.exists() else 'no such file'}")
    prompts = _read_text(path) if path.suffix == ".txt" else read_records(path, _from_record)
    if not prompts:
        raise ValueError(f"{path}: holds no prompt")
    return prompts


class PromptSampler:
    """This replica's prompts of each iteration (``next()``: a list of ``per_replica`` indices into the prompts)."""

    def __init__(self, num_prompts: int, per_replica: int, seed: int, dp_rank: int = 0, dp_size: int = 1) -> None:
        if per_replica * dp_size > num_prompts:
            raise ValueError(
                f"{num_prompts} prompt(s) for {per_replica} per replica x {dp_size} data-parallel replica(s) per "
                f"iteration; give at least {per_replica * dp_size} prompts or lower data.prompts_per_step"
            )
        self.num_prompts, self.per_replica, self.seed = num_prompts, per_replica, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch, self.position = 0, 0

    @property
    def per_iteration(self) -> int:
        return self.per_replica * self.dp_size

    def __next__(self) -> list[int]:
        if self.position + self.per_iteration > self.num_prompts:
            self.epoch, self.position = self.epoch + 1, 0
        order = epoch_permutation(self.num_prompts, self.seed, self.epoch)
        start = self.position + self.dp_rank * self.per_replica
        self.position += self.per_iteration
        return order[start : start + self.per_replica]

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_prompts": self.num_prompts,
            "per_iteration": self.per_iteration,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_prompts", "per_iteration", "seed"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"saved with {key}={state.get(key)!r}, this run has {getattr(self, key)!r}")
        epoch, position = state.get("epoch"), state.get("position")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, position)):
            raise ValueError(f"epoch/position {epoch!r}/{position!r} are not whole numbers >= 0")
        self.epoch, self.position = epoch, position
