"""GGUF files (llama.cpp's single-file models): their header read without loading them.

A GGUF file is a header (key/value metadata, then one record per tensor: name,
shape, type, offset) followed by the tensors' data. A pull reads the header only
(`read_facts`): the architecture, the context length, the chat template and the
quantisation (`general.file_type`), and counts the parameters from the tensor
records; the data is hashed as it is copied like any store file, never parsed.

The reader is our own and small (the format is a dozen value types) so that the API
process and the CLI read a header without numpy or a memory map of the file. It is
bounded: a header is at most `MAX_HEADER_BYTES` and every count and length is checked
against what is left of the file before anything is read, so a hostile file is a
clear `BadRequest`, never a large allocation or a long loop. Large arrays (the
vocabulary, the merges) are skipped, not kept; their strings are stepped over one
length at a time (a pull, once per model: not the request path).
"""

from __future__ import annotations

import struct
from pathlib import Path
from collections.abc import Collection
from typing import Any, BinaryIO

import msgspec

from fleet.errors import BadRequest

MAGIC = b"GGUF"
SUFFIX = ".gguf"
#: Versions read here: 2 and 3 (64-bit counts; version 1 is from 2023 and gone from llama.cpp).
VERSIONS = (2, 3)
#: The most of a file a header may take: a vocabulary of 256 k tokens with its merges
#: is ~15 MB; anything past this is not a header worth reading.
MAX_HEADER_BYTES = 256 << 20
#: Strings kept from the metadata (a chat template is a few KiB); longer ones are
#: refused as a key or skipped as a value we do not keep.
MAX_KEPT_STRING = 256 << 10
MAX_KEY_BYTES = 1 << 16
MAX_TENSORS = 1 << 20
MAX_DIMS = 8
#: Bytes read at once while stepping over an array of strings.
WINDOW_BYTES = 4 << 20

# Value types of the metadata (llama.cpp's gguf_type).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

#: `general.file_type` (llama.cpp's llama_ftype) -> the quantisation's usual name.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
    36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4",
}


class GgufFacts(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a store manifest keeps of a GGUF file's header."""

    #: The file (relative path in the model's folder).
    file: str
    version: int
    #: `general.architecture`: llama, qwen2, gemma3, ...
    architecture: str
    #: `general.name`, as its converter wrote it.
    name: str = ""
    #: `<arch>.context_length`: the positions the model was trained for (tokens).
    context_length: int | None = None
    #: The quantisation: `general.file_type` by name (Q4_1, Q8_0, ...), "" when absent.
    file_type: str = ""
    #: `tokenizer.chat_template` (Jinja), "" when the file has none.
    chat_template: str = ""
    tensors: int = 0
    #: Elements of all tensors: the parameter count.
    parameters: int = 0
    #: A file fleet made at pull (`--quantize`, fleet.gguf_convert): from what and how,
    #: e.g. "safetensors, converted to F16 by fleet, quantized to q8_0 by llama.cpp"; ""
    #: for a GGUF file pulled as it was.
    converted_from: str = ""


class _Reader:
    """Little-endian reads from `f`, each checked against the header's bound."""

    def __init__(self, f: BinaryIO, size: int, origin: str) -> None:
        self.f, self.origin = f, origin
        self.end = min(size, MAX_HEADER_BYTES)

    def bad(self, why: str) -> BadRequest:
        return BadRequest(f"{self.origin} is not a GGUF file fleet can read: {why}")

    def take(self, n: int) -> bytes:
        if n < 0 or self.f.tell() + n > self.end:
            raise self.bad("its header runs past the end of the file" if self.end < MAX_HEADER_BYTES
                           else f"its header is over {MAX_HEADER_BYTES} bytes")
        data = self.f.read(n)
        if len(data) != n:
            raise self.bad("the file is cut short")
        return data

    def skip(self, n: int) -> None:
        if n < 0 or self.f.tell() + n > self.end:
            raise self.bad("its header runs past the end of the file")
        self.f.seek(n, 1)

    def skip_strings(self, count: int) -> None:
        """Step over `count` strings, reading the file in windows (a vocabulary is ~10^5
        strings: one read each would take a second)."""
        while count:
            start = self.f.tell()
            window = self.f.read(min(WINDOW_BYTES, self.end - start))
            off = 0
            while count and off + 8 <= len(window):
                n = struct.unpack_from("<Q", window, off)[0]
                if off + 8 + n > len(window):
                    break
                off += 8 + n
                count -= 1
            self.f.seek(start + off)
            if off == 0 and count:  # one string longer than a window, or the header ends here
                self.skip(self.u64())
                count -= 1

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self, limit: int) -> str | None:
        """A string, or None (skipped) when it is longer than `limit` bytes."""
        n = self.u64()
        if n > limit:
            self.skip(n)
            return None
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise self.bad("a string is not UTF-8") from None

    def value(self, kind: int, keep: bool = False) -> Any:
        """One metadata value; arrays (unless `keep`) and over-long strings are skipped (None)."""
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        if kind == _STRING:
            return self.string(MAX_KEPT_STRING)
        if kind == _ARRAY:
            item, count = self.u32(), self.u64()
            if item in _SCALARS:
                size = count * struct.calcsize(_SCALARS[item])
                if keep:
                    return list(struct.unpack(f"<{count}{_SCALARS[item][1]}", self.take(size)))
                self.skip(size)
            elif item == _STRING:
                if count * 8 > self.end - self.f.tell():  # each string takes 8 bytes at least
                    raise self.bad("an array counts more strings than the file holds")
                if keep:
                    return self.strings(count)
                self.skip_strings(count)
            else:
                raise self.bad(f"an array of value type {item}")
            return None
        raise self.bad(f"unknown value type {kind}")

    def strings(self, count: int) -> list[str]:
        """`count` strings (a vocabulary), read in windows as `skip_strings` steps."""
        out: list[str] = []
        while len(out) < count:
            start = self.f.tell()
            window = self.f.read(min(WINDOW_BYTES, self.end - start))
            off = 0
            while len(out) < count and off + 8 <= len(window):
                n = struct.unpack_from("<Q", window, off)[0]
                if off + 8 + n > len(window):
                    break
                out.append(window[off + 8:off + 8 + n].decode("utf-8", "replace"))
                off += 8 + n
            self.f.seek(start + off)
            if off == 0:  # a string longer than a window, or the header ends here
                out.append(self.take(self.u64()).decode("utf-8", "replace"))
        return out


def read_facts(path: Path, rel: str, origin: str) -> GgufFacts:
    """The header facts of the GGUF file `path` (stored as `rel`); `BadRequest` naming
    `origin` when it is not one fleet can read."""
    version, meta, tensors, parameters = read_metadata(path, origin)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise BadRequest(f"{origin}: the GGUF file names no general.architecture")
    ctx = meta.get(f"{arch}.context_length")
    ftype = meta.get("general.file_type")
    template = meta.get("tokenizer.chat_template")
    return GgufFacts(
        file=rel, version=version, architecture=arch, name=str(meta.get("general.name") or ""),
        context_length=int(ctx) if isinstance(ctx, int) and ctx > 0 else None,
        file_type=FILE_TYPES.get(ftype, f"type {ftype}") if isinstance(ftype, int) else "",
        chat_template=template if isinstance(template, str) else "",
        tensors=tensors, parameters=parameters,
    )


def read_metadata(path: Path, origin: str, arrays: Collection[str] = ()) -> tuple[int, dict[str, Any], int, int]:
    """(version, metadata, tensors, parameters) of the GGUF file `path`: scalars and
    strings, and the arrays named in `arrays` (a runtime's vocabulary); other arrays are
    stepped over."""
    with open(path, "rb") as f:
        r = _Reader(f, path.stat().st_size, origin)
        if r.take(4) != MAGIC:
            raise r.bad("it does not start with GGUF")
        version = r.u32()
        if version not in VERSIONS:
            raise r.bad(f"version {version} (fleet reads versions {', '.join(map(str, VERSIONS))}, little-endian)")
        tensors, keys = r.u64(), r.u64()
        if tensors > MAX_TENSORS:
            raise r.bad(f"{tensors} tensors")
        meta: dict[str, Any] = {}
        for _ in range(keys):
            key = r.string(MAX_KEY_BYTES)
            if key is None:
                raise r.bad("a metadata key is over 64 KiB")
            meta[key] = r.value(r.u32(), keep=key in arrays)
        parameters = 0
        for _ in range(tensors):
            if r.string(MAX_KEY_BYTES) is None:
                raise r.bad("a tensor name is over 64 KiB")
            dims = r.u32()
            if dims > MAX_DIMS:
                raise r.bad(f"a tensor of {dims} dimensions")
            count = 1
            for _ in range(dims):
                count *= r.u64()
            parameters += count
            r.skip(12)  # its type (u32) and data offset (u64)
    return version, meta, tensors, parameters


def is_gguf(rel: str) -> bool:
    return rel.lower().endswith(SUFFIX)
