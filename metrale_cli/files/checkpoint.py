"""A model checkpoint's tensor names and shapes, from its safetensors headers alone.

A checkpoint is `model.safetensors`, or `model.safetensors.index.json` and the shards its
`weight_map` names, in a folder (a model directory, a cached hub snapshot) or on the hub (the
index downloaded, each shard's header read with two ranged reads). No tensor's data is read: the
headers of a 30 GB checkpoint read in milliseconds (docs/benchmarks.md). Every header is
validated as an adapter's is (files/safetensors_header.py), and the files together as well: a
tensor in two shards, an index naming a shard that is not there or a tensor its shard lacks, a
count past any real checkpoint's is a FormatError naming the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from metrale_cli.errors import FormatError, UsageError
from metrale_cli.files.hub import HubId, fetch, on_hub, remote_header
from metrale_cli.files.jsondoc import load_json, shown
from metrale_cli.files.regular import refuse_not_regular
from metrale_cli.files.safetensors_header import SafetensorsHeader, TensorInfo, read_header

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Far above any published checkpoint (Kimi K2: 1T parameters in 62 shards and ~150k tensors,
# per-expert weights and their scales; Llama 3.1 405B: 191 shards) and low enough that reading
# every header stays quick: past them a checkpoint is malformed, not bigger.
MAX_SHARDS = 4096
MAX_TENSORS = 1 << 21
# An index is names and file names; past this it is not an index.
MAX_INDEX_BYTES = 256 << 20


@dataclass(frozen=True)
class Checkpoint:
    """Every tensor of a checkpoint by name, from its headers."""

    # Where it was read: a file path (`.../model.safetensors`, `.../model.safetensors.index.json`)
    # or `org/name/model.safetensors...` on the hub.
    source: str
    files: int
    tensors: dict[str, TensorInfo]


def read_local(folder: Path) -> Checkpoint | None:
    """The checkpoint in `folder` (its index and shards, else `model.safetensors`); None when
    the folder holds neither."""
    index, single = folder / INDEX, folder / SINGLE
    refuse_not_regular(index)
    refuse_not_regular(single)
    if index.is_file():
        return _sharded(str(index), _read_index(index), lambda shard: _local_shard(folder, shard))
    if single.is_file():
        return _one(str(single), read_header(single))
    return None


def read_hub(hub: HubId, snapshot: Path, online: bool) -> Checkpoint | None:
    """The checkpoint of `hub`, each file from `snapshot` (its local cache) when it is there;
    with `online` a missing index is downloaded into the cache and a missing shard's header read
    with two ranged reads (never its data). None when neither the cache nor (`online`) the hub
    holds `model.safetensors` or an index."""

    def header_of(name: str) -> SafetensorsHeader:
        local = snapshot / name
        refuse_not_regular(local)
        if local.is_file():
            return read_header(local)
        if not online:
            raise UsageError(f"{hub}: {INDEX} names {name}, which is not in the local Hugging "
                             f"Face cache ({snapshot}); pass --online to read its header from "
                             "the hub")
        return remote_header(hub, name)

    refuse_not_regular(snapshot / INDEX)
    if (snapshot / INDEX).is_file() or (online and on_hub(hub, INDEX)):
        index = fetch(hub, INDEX, online)
        return _sharded(f"{hub}/{INDEX}", _read_index(index), header_of)
    refuse_not_regular(snapshot / SINGLE)
    if (snapshot / SINGLE).is_file() or (online and on_hub(hub, SINGLE)):
        return _one(f"{hub}/{SINGLE}", header_of(SINGLE))
    return None


def _one(source: str, header: SafetensorsHeader) -> Checkpoint:
    if len(header.tensors) > MAX_TENSORS:
        raise FormatError(f"{source}: {len(header.tensors):,} tensors, above the "
                          f"{MAX_TENSORS:,} that metrale reads; not a real checkpoint")
    return Checkpoint(source, 1, header.tensors)


def _local_shard(folder: Path, shard: str) -> SafetensorsHeader:
    path = folder / shard
    refuse_not_regular(path)
    if not path.is_file():
        raise FormatError(f"{folder / INDEX}: names shard {shard!r}, which is not in {folder}")
    return read_header(path)


def _read_index(path: Path) -> dict[str, str]:
    """The index's `weight_map` (tensor name -> shard file name), checked: shard names are plain
    file names in the same folder, and there are not more of them than a real checkpoint has."""
    try:
        size = path.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise FormatError(f"{path}: {size:,} bytes, not a checkpoint index")
        text = path.read_bytes()
    except OSError as exc:
        raise FormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    doc = load_json(path, text, "checkpoint index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise FormatError(f"{path}: no 'weight_map' object of tensor names to shard file names")
    shards = set(weight_map.values())
    for shard in shards:
        if not shard or shard in (".", "..") or "/" in shard or "\\" in shard:
            # The index is input: a shard outside the folder is a path it may not name.
            raise FormatError(f"{path}: shard {shown(shard)} is not a file name in the index's "
                              "folder")
    if len(shards) > MAX_SHARDS or len(weight_map) > MAX_TENSORS:
        raise FormatError(f"{path}: {len(weight_map):,} tensors in {len(shards):,} shards, "
                          f"above the {MAX_TENSORS:,} and {MAX_SHARDS:,} that metrale reads; not "
                          "a real checkpoint")
    return weight_map


def _sharded(source: str, weight_map: dict[str, str],
             header_of: Callable[[str], SafetensorsHeader]) -> Checkpoint:
    """Every shard's header, the tensors together: each in one shard only, each the index
    names in the shard it names."""
    tensors: dict[str, TensorInfo] = {}
    where: dict[str, str] = {}
    for shard in sorted(set(weight_map.values())):
        header = header_of(shard)
        for name, info in header.tensors.items():
            if name in tensors:
                raise FormatError(f"{source}: tensor {name!r} is in two shards ({where[name]} "
                                  f"and {shard})")
            if len(tensors) == MAX_TENSORS:
                raise FormatError(f"{source}: more than {MAX_TENSORS:,} tensors; not a real "
                                  "checkpoint")
            tensors[name] = info
            where[name] = shard
    for name, shard in weight_map.items():
        if where.get(name) != shard:
            raise FormatError(f"{source}: names tensor {name!r} in {shard}, whose header does "
                              "not hold it")
    return Checkpoint(source, len(set(weight_map.values())), tensors)

