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

try:
    import numpy
except ImportError:  # torch runs without it: tensors are then copied rather than viewed
    numpy = None

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


def _numpy_dtypes() -> dict[torch.dtype, Any]:
    """Each dtype that numpy holds as well, with numpy's dtype for it (none without numpy)."""
    found: dict[torch.dtype, Any] = {}
    if numpy is None:
        return found
    for name in ("float64", "float32", "float16", "int64", "int32", "int16", "int8",
                 "uint64", "uint32", "uint16", "uint8", "bool", "complex64", "complex128"):
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):  # an older torch lacks the unsigned ones
            continue
        try:
            numpy_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        except (TypeError, RuntimeError):  # one this torch does not hand to numpy
            continue
        if torch.from_numpy(numpy.empty(0, numpy_dtype)).dtype == dtype:
            found[dtype] = numpy_dtype
    return found


# A tensor of these dtypes is viewed, and read back, through numpy: half the time the
# same through torch's own views takes.
_IN_NUMPY = _numpy_dtypes()
_STRIDED = torch.strided


def dump(tensor: torch.Tensor) -> bytes | bytearray:
    """The tensor's dtype, shape and values as one safetensors blob."""
    written = pieces(tensor)
    return b"".join(written) if type(written) is tuple else written


def pieces(tensor: torch.Tensor) -> bytearray | tuple[bytes, Any]:
    """What the codec hands on: ``dump``'s blob, or, for a contiguous tensor on the CPU,
    its header and a view of its own memory to be written one after the other — so
    keying and sending it copy nothing. Any other tensor is copied once, into the blob."""
    known = None
    # _label refuses a strided CPU tensor for its dtype alone, and a refused dtype is
    # never in _HEADS: one whose dtype and shape were written before is not checked
    # again (the checks were a third of the opcodes of writing a small tensor).
    if isinstance(tensor, torch.Tensor) and tensor.is_cpu and tensor.layout is _STRIDED:
        known = _HEADS.get((tensor.dtype, tensor.shape))
    if known is None:
        known = _head(tensor)
    head, size = known
    values = _in_place(tensor) if size else None
    if values is not None:
        return head, values
    start = len(head)
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
        target.view(tensor.shape).copy_(source)
    return blob


# A training loop writes and reads the same few shapes every step: their headers are
# made (and read, checked) once, not once a tensor. Bounded, and emptied when full.
_HEADS: dict[tuple[torch.dtype, tuple[int, ...]], tuple[bytes, int]] = {}
_READ_HEADS: dict[bytes, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
_MOST_HEADS = 512


def _head(tensor: Any) -> tuple[bytes, int]:
    """The header length and header of a tensor of this one's dtype and shape, and how
    many bytes of values follow them; what cannot be written is refused here."""
    label = _label(tensor)
    shape = tuple(tensor.shape)
    key = (tensor.dtype, shape)
    known = _HEADS.get(key)
    if known is None:
        size = tensor.numel() * tensor.element_size()
        header = json.dumps(
            {"t": {"data_offsets": [0, size], "dtype": label, "shape": list(shape)}},
            separators=(",", ":"), sort_keys=True,
        ).encode()
        header += b" " * (-(len(header) + _LENGTH.size) % _ALIGN)
        known = _LENGTH.pack(len(header)) + header, size
        if len(_HEADS) >= _MOST_HEADS:
            _HEADS.clear()
        _HEADS[key] = known
    return known


def _in_place(tensor: torch.Tensor) -> Any:
    """The tensor's values as a buffer over its own memory, or None where there is no
    such buffer (another device, a strided view, lazy conj/neg bits, a shell dtype)."""
    if (not tensor.is_cpu or not tensor.is_contiguous() or tensor.is_conj()
            or tensor.is_neg()):
        return None
    dtype = tensor.dtype
    try:  # through numpy's buffer; a torch without numpy copies instead
        # force= only detaches, the tensor being on the CPU with no lazy bits, and in
        # less time than detach() does.
        if dtype in _IN_NUMPY:
            return tensor.numpy(force=True).ravel().view(numpy.uint8)
        if dtype in _SHELL_DTYPES:
            return None
        # One torch view, as bytes (a 0-dim tensor is given its one dimension first).
        as_bytes = (tensor if tensor.dim() else tensor.view(1)).view(torch.uint8)
        return as_bytes.numpy(force=True).ravel()
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
    view = memoryview(blob)
    dtype, shape, start, size = _header(view)
    if size == 0:
        return torch.empty(shape, dtype=dtype)
    if view.readonly:  # torch needs memory it may write to: this is the one copy
        blob, start = bytearray(view[start:]), 0
    # Otherwise a buffer received for us alone (the wire's): the tensor lives in it.
    in_numpy = _IN_NUMPY.get(dtype)
    if in_numpy is not None:  # all of it from start; positional, as keywords cost a third
        return torch.from_numpy(numpy.frombuffer(blob, in_numpy, -1, start).reshape(shape))
    if dtype in _SHELL_DTYPES:  # no kernels of its own: shaped as bytes, then viewed
        return torch.frombuffer(blob, dtype=torch.uint8, offset=start).view(shape).view(dtype)
    # size= is read a third sooner than a bare tuple
    return torch.frombuffer(blob, dtype=dtype, offset=start).view(size=shape)


def _header(blob: Any) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """The dtype, shape, start and size of the values of a blob, checked against it."""
    view = blob if type(blob) is memoryview else memoryview(blob)
    if view.nbytes < _LENGTH.size:
        raise _corrupt(f"it is {view.nbytes} bytes long, shorter than its own header length")
    (length,) = _LENGTH.unpack_from(view, 0)
    start = _LENGTH.size + length
    if start > view.nbytes:
        raise _corrupt(f"its header says it is {length} bytes, past the end of the blob")
    raw = view[_LENGTH.size:start].tobytes()  # a third sooner than bytes() of the slice
    known = _READ_HEADS.get(raw)
    if known is None:
        known = _read_header(view, raw, start)
        if len(_READ_HEADS) >= _MOST_HEADS:
            _READ_HEADS.clear()
        _READ_HEADS[raw] = known
    elif view.nbytes - start != known[3]:  # read and checked before but for its length
        dtype, shape, start, size = known
        raise _corrupt(f"a {_WRITTEN[dtype]} tensor of shape {list(shape)} is {size} bytes, "
                       f"and this one has {view.nbytes - start}")
    return known


def _read_header(view: memoryview, raw: bytes,
                 start: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
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
    return dtype, tuple(shape), start, size  # a tuple: the cached one is handed out as it is


def _corrupt(why: str) -> CorruptObject:
    return CorruptObject(f"these bytes are not a tensor written by somatize.torch: {why}")


def register() -> None:
    """Says, once per process, that a tensor is written down by this module."""
    from .._codec import codec

    codec(KIND, torch.Tensor, dump=pieces, load=load)
