"""DCP's reading side without code execution from the files: a checkpoint is data, so loading one runs no code.

Plain ``dcp.load`` unpickles the ``.metadata`` file with ``pickle.load`` and every non-tensor value (e.g. an
optimizer's learning rate) with ``torch.load(weights_only=False)``: a crafted checkpoint could run anything. Here
the metadata is read by an unpickler that only resolves the few DCP metadata classes (and torch dtypes) a checkpoint
holds, and non-tensor values by ``torch.load(weights_only=True)``; tensors DCP already reads weights-only. Anything
else in the file is refused (``CheckpointError``). Our own per-rank state is not pickled at all (see ``dcp.py``).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from runtime import torch_compat
from runtime.checkpoint.verify import CheckpointError

# What a DCP .metadata pickle may name: torch's own classes (version-specific, runtime/torch_compat.py) and paths.
_METADATA_GLOBALS = torch_compat.DCP_METADATA_GLOBALS | {
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class MetadataUnpicklingError(pickle.UnpicklingError):
    """The metadata refers to something a DCP checkpoint's metadata never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise MetadataUnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata unpickling resolves only DCP's own metadata classes. The metadata read
    once is kept: ``load_checkpoint`` reads it before ``dcp.load`` (``read_metadata``), so a refused or missing
    ``.metadata`` is one ``CheckpointError`` and ``dcp.load`` never starts (it logs each failed read with its
    traceback, then tries a per-rank ``__0.metadata`` that a ``FileSystemWriter`` never writes)."""

    refused: MetadataUnpicklingError | None = None  # why the metadata was refused, for the caller's message

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read: dict[Any, Metadata] = {}  # rank (None: the global metadata) -> what was read

    def check_metadata(self) -> None:
        """Read the checkpoint's metadata now; ``CheckpointError`` (one line naming the checkpoint) when it is refused
        (verified, yet not DCP metadata: written by something else), missing or unreadable."""
        try:
            self.read_metadata()
        except MetadataUnpicklingError as exc:
            raise CheckpointError(f"checkpoint {self.path}: refusing its .metadata: {exc}") from None
        except Exception as exc:  # missing (a marker that does not list it), not a pickle at all
            why = " ".join(str(exc).split())[:300]
            raise CheckpointError(
                f"checkpoint {self.path}: cannot read its .metadata ({type(exc).__name__}: {why})"
            ) from None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = self._read.get(rank)
        if metadata is None:
            path = self._get_metadata_path(rank)
            try:
                with self.fs.create_stream(path, "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
                if not isinstance(metadata, Metadata):
                    raise MetadataUnpicklingError(f"it holds a {type(metadata).__name__}, not DCP metadata")
            except MetadataUnpicklingError as exc:
                self.refused = self.refused or exc
                raise
            self._read[rank] = metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor values weights-only (numbers, strings, containers)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            torch_compat.set_state_dict_element(
                self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded
            )
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
