"""How a torch tensor is written down: a safetensors file holding one tensor, ``"t"``.

The bytes are an 8-byte little-endian header length, a JSON header (``dtype``,
``shape``, ``data_offsets``; keys sorted, padded with spaces to a multiple of 16) and
the raw values, C-ordered. Nothing in it depends on where the tensor lived, its
strides, its gradient or the run: equal dtype, shape and bits give equal bytes, which
is what lets a tensor input be part of a key. For the dtypes safetensors knows the
blob is a valid safetensors file; the others (complex128, complex32, the shell
dtypes) use torch's own name. No pickle, so reading a blob runs no code.

Writing a contiguous CPU tensor copies nothing: its header and a view of its memory
are handed on; any other tensor is copied once, straight from wherever it is (a GPU
included) into the blob. Reading a writable buffer (what the wire receives into)
makes a tensor over that buffer; reading bytes copies once.
Quantized, sparse and meta tensors are refused: they are not a dtype and a block of
values. Bytes that are not such a blob are a ``CorruptObject`` whatever they hold, and
are checked before torch is asked to make anything of them; only a dtype this torch
does not know is an ``UnwritableError``, since the bytes may well be right.
"""

from __future__ import annotations

import json
import math
import re
import struct
from typing import Any

import torch

from .._errors import CorruptObject, UnwritableError

__all__ = ["KIND", "dump", "load", "pieces", "register"]

KIND = "torch.Tensor"

_LENGTH = struct.Struct("<Q")
_LARGEST = 2**63 - 1  # torch's sizes and strides are int64
_LABEL = re.compile(r"[A-Za-z0-9_]{1,40}").fullmatch  # what could be a dtype's name
# 16 rather than safetensors' 8, so the widest dtype (complex128) can be viewed in place.
_ALIGN = 16

# The names safetensors reads; every other dtype is written under torch's own name.
_SAFETENSORS = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2": "F8_E5M2", "float8_e5m2fnuz": "F8_E5M2FNUZ", "complex64": "C64",
}
_OTHERS = (
    "complex128", "complex32", "float8_e8m0fnu", "float4_e2m1fn_x2",
    "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
    *(f"int{n}" for n in range(1, 8)), *(f"uint{n}" for n in range(1, 8)),
)
# Shell dtypes: torch can hold them but has no copy kernel, so their bits are moved
# as uint8 of the same size.
_SHELLS = frozenset(f"{sign}int{n}" for sign in ("", "u") for n in range(1, 8))


def _tables() -> tuple[dict[torch.dtype, str], dict[str, torch.dtype]]:
    written: dict[torch.dtype, str] = {}
    for name in (*_SAFETENSORS, *_OTHERS):
        dtype = getattr(torch, name, None)  # an older torch lacks the newest ones
        if isinstance(dtype, torch.dtype):
            written[dtype] = _SAFETENSORS.get(name, name)
    return written, {label: dtype for dtype, label in written.items()}


_WRITTEN, _READ = _tables()
_SHELL_DTYPES = frozenset(getattr(torch, n) for n in _SHELLS if hasattr(torch, n))


def dump(tensor: torch.Tensor) -> bytes | bytearray:
    """The tensor's dtype, shape and values as one safetensors blob."""
    written = pieces(tensor)
    return b"".join(written) if type(written) is tuple else written


def pieces(tensor: torch.Tensor) -> bytearray | tuple[bytes, Any]:
    """What the codec hands on: ``dump``'s blob, or, for a contiguous tensor on the CPU,
    its header and a view of its own memory to be written one after the other — so
    keying and sending it copy nothing. Any other tensor is copied once, into the blob."""
    label = _label(tensor)
    shape = tensor.shape
    size = tensor.numel() * tensor.element_size()
    head = _written_head(label, tuple(shape), size)
    start = len(head)
    values = _in_place(tensor.detach()) if size else None
    if values is not None:
        return head, values
    blob = bytearray(start + size)
    blob[:start] = head
    if size:
        target = torch.frombuffer(blob, dtype=torch.uint8, offset=start, count=size)
        source = tensor.detach()
        if source.dtype in _SHELL_DTYPES:
            source = source.view(torch.uint8)
        else:
            target = target.view(source.dtype)
        # One pass: device, layout and lazy conj/neg bits are all resolved by copy_.
        target.view(shape).copy_(source)
    return blob


# A training loop writes and reads the same few shapes every step: their headers are
# made (and read, checked) once, not once a tensor. Bounded, and emptied when full.
_HEADS: dict[tuple, bytes] = {}
_READ_HEADS: dict[bytes, tuple[torch.dtype, list[int], int, int]] = {}
_MOST_HEADS = 512


def _written_head(label: str, shape: tuple[int, ...], size: int) -> bytes:
    """The header length and the header of a tensor of this dtype and shape."""
    key = (label, shape)
    head = _HEADS.get(key)
    if head is None:
        header = json.dumps(
            {"t": {"data_offsets": [0, size], "dtype": label, "shape": list(shape)}},
            separators=(",", ":"), sort_keys=True,
        ).encode()
        header += b" " * (-(len(header) + _LENGTH.size) % _ALIGN)
        head = _LENGTH.pack(len(header)) + header
        if len(_HEADS) >= _MOST_HEADS:
            _HEADS.clear()
        _HEADS[key] = head
    return head


def _in_place(tensor: torch.Tensor) -> Any:
    """The tensor's values as a buffer over its own memory, or None where there is no
    such buffer (another device, a strided view, lazy conj/neg bits, a shell dtype)."""
    if (tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_conj()
            or tensor.is_neg() or tensor.dtype in _SHELL_DTYPES):
        return None
    try:  # through numpy's buffer; a torch without numpy copies instead
        return tensor.reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None


def _label(tensor: Any) -> str:
    if not isinstance(tensor, torch.Tensor):
        raise UnwritableError(f"the torch.Tensor codec was handed a {type(tensor).__qualname__}")
    if tensor.layout is not torch.strided:
        raise UnwritableError(
            f"a {tensor.layout} tensor cannot be written down as a block of values; "
            "convert it with .to_dense() first"
        )
    if tensor.is_quantized:
        raise UnwritableError(
            f"a quantized {tensor.dtype} tensor carries a scale and a zero point beside "
            "its values; write .dequantize() or .int_repr() instead"
        )
    if tensor.is_meta:
        raise UnwritableError("a tensor on the meta device has no values to write down; "
                              "materialise it on a real device first")
    label = _WRITTEN.get(tensor.dtype)
    if label is None:
        raise UnwritableError(f"tensors of dtype {tensor.dtype} cannot be written down "
                              "yet; convert it to a dtype of the same width first")
    return label


def load(blob: bytes) -> torch.Tensor:
    """The tensor a blob holds, alive again on the CPU."""
    dtype, shape, start, size = _header(blob)
    if size == 0:
        return torch.empty(shape, dtype=dtype)
    view = memoryview(blob)
    if view.readonly:  # torch needs memory it may write to: this is the one copy
        values = torch.frombuffer(bytearray(view[start:]), dtype=torch.uint8)
    else:  # a buffer received for us alone (the wire's): the tensor lives in it
        values = torch.frombuffer(blob, dtype=torch.uint8, offset=start, count=size)
    if dtype in _SHELL_DTYPES:
        return values.view(shape).view(dtype)
    return values.view(dtype).view(shape)


def _header(blob: Any) -> tuple[torch.dtype, list[int], int, int]:
    view = memoryview(blob)
    if view.nbytes < _LENGTH.size:
        raise _corrupt(f"it is {view.nbytes} bytes long, shorter than its own header length")
    (length,) = _LENGTH.unpack_from(view, 0)
    start = _LENGTH.size + length
    if start > view.nbytes:
        raise _corrupt(f"its header says it is {length} bytes, past the end of the blob")
    raw = bytes(view[_LENGTH.size:start])
    known = _READ_HEADS.get(raw)
    if known is not None:  # read and checked before; only the length is this blob's
        dtype, shape, start, size = known
        if view.nbytes - start != size:
            raise _corrupt(f"a {_WRITTEN[dtype]} tensor of shape {shape} is {size} bytes, "
                           f"and this one has {view.nbytes - start}")
        return dtype, list(shape), start, size
    read = _read_header(view, raw, start)
    if len(_READ_HEADS) >= _MOST_HEADS:
        _READ_HEADS.clear()
    _READ_HEADS[raw] = read
    return read[0], list(read[1]), read[2], read[3]


def _read_header(view: memoryview, raw: bytes, start: int) -> tuple[torch.dtype, list[int], int, int]:
    try:
        entry = json.loads(raw)["t"]
        label, shape, (first, last) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (ValueError, LookupError, TypeError, RecursionError) as exc:
        raise _corrupt(f"its header cannot be read ({type(exc).__name__}: {exc})") from None
    if not (type(shape) is list and all(type(n) is int and n >= 0 for n in shape)):
        raise _corrupt(f"its shape {shape!r} is not a list of sizes")
    if math.prod(max(n, 1) for n in shape) > _LARGEST:
        raise _corrupt(f"its shape {shape!r} is larger than any tensor can be")
    if type(label) is not str or not _LABEL(label):
        raise _corrupt(f"its dtype {label!r} is not a dtype's name")
    dtype = _READ.get(label)
    if dtype is None:
        raise UnwritableError(
            f"a tensor was written with dtype {label!r}, which this torch "
            f"({torch.__version__}) cannot hold; read it with the torch that wrote it"
        )
    size = math.prod(shape) * dtype.itemsize
    if type(first) is not int or type(last) is not int or (first, last) != (0, size) \
            or view.nbytes - start != size:
        raise _corrupt(f"a {label} tensor of shape {shape} is {size} bytes, and this one "
                       f"has {view.nbytes - start} (offsets {first}..{last})")
    return dtype, shape, start, size


def _corrupt(why: str) -> CorruptObject:
    return CorruptObject(f"these bytes are not a tensor written by somatize.torch: {why}")


def register() -> None:
    """Says, once per process, that a tensor is written down by this module."""
    from .._codec import codec

    codec(KIND, torch.Tensor, dump=pieces, load=load)
