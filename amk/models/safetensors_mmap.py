"""Read safetensors files as memory-mapped tensors: no copy, pages come in when touched.

The format is 8 bytes of little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the raw data. Each tensor is torch.frombuffer over a copy-on-write mmap
of the file (writable, so torch does not warn; nothing is ever written back). Sharded
checkpoints list their files in model.safetensors.index.json.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

from amk.errors import TraceError

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
          "F8_E5M2": torch.float8_e5m2}


def read_file(path: str | Path) -> dict[str, torch.Tensor]:
    """{name: tensor} of one .safetensors file, every tensor a view of one mmap."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise TraceError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise TraceError(f"{path}: unreadable safetensors header ({e})") from None
        size = path.stat().st_size
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else None
    out: dict[str, torch.Tensor] = {}
    base = 8 + n
    whole = torch.frombuffer(mm, dtype=torch.uint8) if mm is not None else None   # one storage
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = DTYPES.get(info["dtype"])
        if dt is None:
            raise TraceError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which AMK cannot read")
        lo, hi = info["data_offsets"]
        shape = tuple(info["shape"])
        count = hi - lo
        if count == 0 or mm is None:
            out[name] = torch.empty(shape, dtype=dt)
            continue
        flat = whole[base + lo:base + hi]
        if (base + lo) % torch.empty((), dtype=dt).element_size():
            flat = flat.clone()          # unaligned for its dtype: the only copy we make
        out[name] = flat.view(dt).view(shape)
    return out


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The .safetensors files of a checkpoint folder (the index's shards, else every file)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise TraceError(f"{folder}: the index lists shards that are not there: {missing[:3]}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TraceError(f"{folder}: no *.safetensors files (AMK reads safetensors checkpoints; "
                         f"save with save_pretrained(..., safe_serialization=True))")
    return files


def read_checkpoint(folder: str | Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(folder):
        tensors.update(read_file(f))
    return tensors
