"""ONNX files of any size. Protobuf refuses to serialise a message over 2 GiB, so a graph whose weights come near
that (an fp32 model of ~500M parameters and up) keeps them in one external data file beside it, `NAME.data`, as
torch.onnx and ONNX Runtime's builder write them; onnxruntime and onnx.load read it by the location the graph
names. These helpers save, check, copy and size a graph together with that file."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

# Bytes of weights above which they go to the external file: under 2 GiB with room for the graph and metadata
# (the tokenizer travels in the metadata). A module constant so tests can send a tiny model the large way.
EXTERNAL_ABOVE = 1_800_000_000


def data_file(path: Path) -> Path:
    """Where save() puts the weights of a large graph at ``path``."""
    return path.with_name(path.name + ".data")


def weight_bytes(proto: onnx.ModelProto) -> int:
    """The bytes the graph's initializers hold, wherever they are stored."""
    total = 0
    for t in proto.graph.initializer:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        total += math.prod(t.dims) * itemsize
    return total


def save(proto: onnx.ModelProto, path: Path, check: bool = True) -> None:
    """Write ``proto`` to ``path``, checked first (onnx.checker, full) when ``check``; the graph file is renamed
    into place last. Weights over EXTERNAL_ABOVE go to data_file(path), written before the graph that names it.
    A large proto's tensors are emptied by the write (onnx moves them out): load the file again to reuse it."""
    tmp = path.with_name(path.name + ".tmp")
    data = data_file(path)
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    if weight_bytes(proto) > EXTERNAL_ABOVE:
        onnx.save(proto, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name,
                  size_threshold=1024)
        if check:
            onnx.checker.check_model(str(tmp), full_check=True)  # by path: the checker cannot hold it in memory
    else:
        if check:
            onnx.checker.check_model(proto, full_check=True)
        onnx.save(proto, str(tmp))
    tmp.replace(path)


def external_files(path: Path) -> list[str]:
    """The external data files the graph at ``path`` names, relative to its folder."""
    proto = onnx.load(str(path), load_external_data=False)
    return sorted({ExternalDataInfo(t).location for t in proto.graph.initializer if uses_external_data(t)})


def files_of(path: Path) -> list[str]:
    """The graph's file name and those of its external data: what travels with it (artifacts, copies)."""
    return [path.name, *external_files(path)]


def total_bytes(path: Path) -> int:
    """The graph's size on disk with its external data."""
    return sum((path.parent / name).stat().st_size for name in files_of(path))


def copy(source: Path, target: Path) -> None:
    """The graph at ``source`` as ``target``, its external data (if any) renamed to data_file(target)."""
    if not external_files(source):
        shutil.copyfile(source, target)
        return
    save(onnx.load(str(source)), target, check=False)


def remove(path: Path) -> None:
    """Delete the graph and its external data."""
    if path.exists():
        for name in files_of(path):
            (path.parent / name).unlink(missing_ok=True)
