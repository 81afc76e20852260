"""Read a torch.distributed.checkpoint folder without running pickled code.

torch.distributed.checkpoint keeps its index (``.metadata``) as a plain pickle and reads it with
``pickle.load``, and its default planner reads non-tensor values (the optimizer's param_groups)
with ``torch.load(weights_only=False)``: a checkpoint folder on shared storage that someone else
can write would run their code in every process that resumes from it. Here the index is read by
an unpickler that knows only the checkpoint's own record types (anything else is refused before
it is called), every file the index points to must be a plain name inside the folder, and the
non-tensor values go through ``torch.load(weights_only=True)``. The tensors themselves are already
read with ``weights_only=True`` by torch.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.planner import ReadItem


class UnsafeCheckpointError(ValueError):
    """The checkpoint's index names something a checkpoint index never holds."""


# What torch 2.13 writes into .metadata (one record type per tensor, chunk, byte value and file
# slice) and the plain values inside them; the dtypes are added below.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a lookup by name
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # where the checkpoint was saved (informational)
} | {("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(f"the checkpoint index refers to {module}.{name}, which a "
                                        "checkpoint index never holds; refusing to load it") from None


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose index is read by the allow-list unpickler and checked to stay in the folder."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _IndexUnpickler(stream).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeCheckpointError(f"{path} is not a checkpoint index")
        for info in (metadata.storage_data or {}).values():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or pathlib.PurePath(name).name != name or name in ("", ".", ".."):
                raise UnsafeCheckpointError(f"{path} points outside its folder ({name!r})")
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor values with torch.load(weights_only=True)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:  # as DefaultLoadPlanner does, minus the unrestricted unpickling
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
