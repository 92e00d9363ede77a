"""Minimal GGUF v3 writer (and reader, for checking what was written), pure Python.

Only what the MTP side file needs: F32 tensors, 32-byte alignment, metadata values of
type uint32, int32, float32, string, bool and arrays of those. Little-endian throughout.

File layout (GGUF v3, as ggml reads it):
  magic "GGUF", u32 version = 3, u64 n_tensors, u64 n_kv,
  n_kv x (string key, u32 value type, value),
  n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset),
  zero padding to the alignment, tensor data (each tensor starting at an aligned offset
  relative to the start of the data section, zero-padded in between).
A string is u64 length + bytes (no NUL). ne[0] is the fastest-varying (innermost) dimension,
so a row-major (rows, cols) matrix has ne = (cols, rows).
"""
import struct

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32

# value types (gguf_type)
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, \
    T_ARRAY, T_UINT64, T_INT64, T_FLOAT64 = range(13)
GGML_TYPE_F32 = 0

_SCALAR_FMT = {T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h", T_UINT32: "<I",
               T_INT32: "<i", T_FLOAT32: "<f", T_BOOL: "<?", T_UINT64: "<Q", T_INT64: "<q",
               T_FLOAT64: "<d"}


def _str(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(vtype, v):
    if vtype == T_STRING:
        return _str(v)
    return struct.pack(_SCALAR_FMT[vtype], v)


class GGUFWriter:
    """Collect metadata and tensors, then write() them in insertion order."""

    def __init__(self, alignment=ALIGNMENT):
        self.alignment = alignment
        self.kv = []       # (key, type, value bytes)
        self.tensors = []  # (name, ne tuple, float32 bytes)
        self._keys = set()
        self.add_uint32("general.alignment", alignment)

    def _add(self, key, vtype, payload):
        if key in self._keys:
            raise ValueError("duplicate key " + key)
        self._keys.add(key)
        self.kv.append((key, vtype, payload))

    def add_uint32(self, key, v):
        self._add(key, T_UINT32, _value(T_UINT32, int(v)))

    def add_int32(self, key, v):
        self._add(key, T_INT32, _value(T_INT32, int(v)))

    def add_float32(self, key, v):
        self._add(key, T_FLOAT32, _value(T_FLOAT32, float(v)))

    def add_bool(self, key, v):
        self._add(key, T_BOOL, _value(T_BOOL, bool(v)))

    def add_string(self, key, v):
        self._add(key, T_STRING, _value(T_STRING, v))

    def add_array(self, key, elem_type, values):
        body = struct.pack("<IQ", elem_type, len(values))
        body += b"".join(_value(elem_type, v) for v in values)
        self._add(key, T_ARRAY, body)

    def add_tensor_f32(self, name, array):
        """array: numpy array in row-major (C) order; its shape (..., rows, cols) is written
        reversed as ggml's ne (cols, rows, ...)."""
        a = np.ascontiguousarray(np.asarray(array, dtype="<f4"))
        if any(t[0] == name for t in self.tensors):
            raise ValueError("duplicate tensor " + name)
        self.tensors.append((name, tuple(reversed(a.shape)), a.tobytes()))

    def _pad(self, n):
        return (n + self.alignment - 1) // self.alignment * self.alignment

    def write(self, path):
        out = bytearray()
        out += GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(self.tensors), len(self.kv))
        for key, vtype, payload in self.kv:
            out += _str(key) + struct.pack("<I", vtype) + payload
        off = 0
        offsets = []
        for name, ne, data in self.tensors:
            off = self._pad(off)
            offsets.append(off)
            out += _str(name) + struct.pack("<I", len(ne))
            out += b"".join(struct.pack("<Q", n) for n in ne)
            out += struct.pack("<IQ", GGML_TYPE_F32, off)
            off += len(data)
        out += b"\0" * (self._pad(len(out)) - len(out))
        base = len(out)
        for (name, ne, data), o in zip(self.tensors, offsets):
            out += b"\0" * (base + o - len(out))
            out += data
        with open(path, "wb") as f:
            f.write(out)


def read_gguf(path):
    """Read a GGUF file written by GGUFWriter (or any F32-only GGUF with the value types
    above). Returns (metadata dict, {name: numpy array shaped row-major, i.e. reversed ne})."""
    with open(path, "rb") as f:
        buf = f.read()
    pos = 0

    def take(fmt):
        nonlocal pos
        vals = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return vals[0] if len(vals) == 1 else vals

    def rstr():
        nonlocal pos
        n = take("<Q")
        s = buf[pos:pos + n].decode("utf-8")
        pos += n
        return s

    def rval(vtype):
        if vtype == T_STRING:
            return rstr()
        if vtype == T_ARRAY:
            et, n = take("<IQ")
            return [rval(et) for _ in range(n)]
        return take(_SCALAR_FMT[vtype])

    if buf[:4] != GGUF_MAGIC:
        raise ValueError(path + ": not a GGUF file")
    pos = 4
    version, n_tensors, n_kv = take("<IQQ")
    if version != GGUF_VERSION:
        raise ValueError("%s: GGUF version %d, expected 3" % (path, version))
    meta = {}
    for _ in range(n_kv):
        key = rstr()
        meta[key] = rval(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = rstr()
        nd = take("<I")
        ne = [take("<Q") for _ in range(nd)]
        ttype, off = take("<IQ")
        if ttype != GGML_TYPE_F32:
            raise ValueError("%s: tensor %s is not F32" % (path, name))
        infos.append((name, ne, off))
    align = meta.get("general.alignment", ALIGNMENT)
    base = (pos + align - 1) // align * align
    tensors = {}
    for name, ne, off in infos:
        count = int(np.prod(ne)) if ne else 1
        a = np.frombuffer(buf, dtype="<f4", count=count, offset=base + off)
        tensors[name] = a.reshape(tuple(reversed(ne))).copy()
    return meta, tensors
