"""safetensors files written and read tensor by tensor (tensorfiles.py): the writer and the streamed serialisation
give safetensors' own bytes for every dtype we store (its layout: by dtype, then by name); the in-memory parser
gives safetensors' tensors as views, and refuses what safetensors refuses."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load, save

from mlpsurgery.tensorfiles import SafetensorsWriter, parse_bytes, serialized

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.float16, torch.bfloat16, torch.int32, torch.float32,
          torch.float64, torch.int64]


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dt in enumerate(DTYPES):
        x = torch.randn(3, i + 1, generator=g) * 50
        out[f"t{(7 * i) % 10}.{str(dt)[6:]}"] = (x > 0) if dt == torch.bool else x.to(dt)
    out["empty"] = torch.zeros(0, 4)
    out["é.unicode"] = torch.arange(5, dtype=torch.int32)
    return out


# one metadata entry: safetensors writes several in its hash map's order, which varies between processes
@pytest.mark.parametrize("metadata", [None, {"x": json.dumps({"q": 'a"b\\c', "u": "ü"})}, {"ü": "ö"}])
def test_the_writer_and_the_stream_give_safetensors_own_bytes(tmp_path, metadata):
    tensors = _tensors()
    want = save(tensors, metadata=metadata)
    size, chunks = serialized(tensors, metadata)
    assert b"".join(bytes(c) for c in chunks) == want and size == len(want)
    w = SafetensorsWriter(tmp_path / "x.safetensors", {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()},
                          metadata)
    for name in reversed(list(tensors)):  # any order
        w.write(name, tensors[name])
    w.close()
    assert (tmp_path / "x.safetensors").read_bytes() == want


def test_parse_bytes_gives_safetensors_tensors_as_views():
    tensors = _tensors(1)
    buf = bytearray(save(tensors, metadata={"k": "v"}))
    meta, got = parse_bytes(buf)
    ref = load(bytes(buf))
    assert meta == {"k": "v"} and got.keys() == ref.keys()
    lo, hi = torch.frombuffer(buf, dtype=torch.uint8).data_ptr(), torch.frombuffer(buf, dtype=torch.uint8).data_ptr() + len(buf)
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        if t.numel():
            assert lo <= got[name].data_ptr() < hi, name  # a view of the buffer, not a copy


def _with_header(header: dict, data: bytes) -> bytearray:
    raw = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("header, data, match", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "cover"),      # trailing bytes
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "cover"),     # a gap first
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "wrong size|cover"),  # overlap
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "wrong size"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "outside"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "non-negative"),
    ({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, b"\0" * 8, "non-negative"),
])
def test_parse_bytes_refuses_what_safetensors_refuses(header, data, match):
    buf = _with_header(header, data)
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error types
        load(bytes(buf))
    with pytest.raises(ValueError, match=match):
        parse_bytes(buf)
    with pytest.raises(KeyError):
        parse_bytes(_with_header({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}, b"\0"))
    with pytest.raises(ValueError, match="header claims"):
        parse_bytes(bytearray(struct.pack("<Q", 1000) + b"{}"))
