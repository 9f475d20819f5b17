"""What an input file is, from its first bytes: text, a compressed stream of text, a columnar file, or something
pretrain cannot read (an executable, an image, an archive) — and the decompressing reader for the streams.

Compression is recognised by magic number, not by name (``.gz`` / ``.zst`` / ``.bz2`` / ``.xz``): a stream is read
front to back by one worker. A truncated or corrupt stream raises ``ValueError`` naming the file. Binary files are
refused with what they are, so that no one tokenizes an ELF file with ``--errors replace``.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

HEAD_BYTES = 8192
"""Bytes of (decompressed) content looked at to tell text from binary."""

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bzip2", ".xz": "xz"}
"""File-name suffix → compression read as a stream (the suffix is dropped to find the text format inside)."""

_COMPRESSED_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\xfd7zXZ\x00", "xz"),
)
_ZSTD_SKIPPABLE = b"\x2a\x4d\x18"
"""Bytes 1-3 of a zstd skippable frame's magic (0x184D2A50-0x184D2A5F, little-endian), which the decompressor
skips."""
_BZIP2_BLOCK = (b"\x31\x41\x59\x26\x53\x59", b"\x17\x72\x45\x38\x50\x90")
"""After ``BZh1``…``BZh9``: the first block's magic (pi), or the end-of-stream magic of an empty stream."""

# Files that are not text, with what to do instead: (magic, offset, what it is, advice).
_NOT_TEXT = (
    (b"\x7fELF", 0, "an ELF executable or library", "remove it from the inputs"),
    (b"\xcf\xfa\xed\xfe", 0, "a Mach-O executable", "remove it from the inputs"),
    (b"\xca\xfe\xba\xbe", 0, "a Java class or Mach-O universal binary", "remove it from the inputs"),
    (b"\x89PNG\r\n\x1a\n", 0, "a PNG image", "remove it from the inputs"),
    (b"\xff\xd8\xff", 0, "a JPEG image", "remove it from the inputs"),
    (b"GIF87a", 0, "a GIF image", "remove it from the inputs"),
    (b"GIF89a", 0, "a GIF image", "remove it from the inputs"),
    (b"%PDF-", 0, "a PDF document", "extract its text first (e.g. pdftotext FILE)"),
    (b"SQLite format 3\x00", 0, "an SQLite database", "export its text first"),
    (b"\x93NUMPY", 0, "a NumPy array file", "remove it from the inputs"),
    (b"PK\x03\x04", 0, "a zip archive (or docx/xlsx/jar)", "unzip it and pass the text files (unzip FILE)"),
    (b"7z\xbc\xaf\x27\x1c", 0, "a 7-Zip archive", "extract it and pass the text files (7z x FILE)"),
    (b"Rar!\x1a\x07", 0, "a RAR archive", "extract it and pass the text files (unrar x FILE)"),
    (b"\x04\x22\x4d\x18", 0, "an LZ4-compressed file (not supported)", "decompress it first (lz4 -d FILE)"),
    (b"ustar", 257, "a tar archive", "extract it and pass the directory (tar -xf FILE)"),
    (b"\xff\xfe", 0, "UTF-16 (or UTF-32) text", "convert it to UTF-8 first (iconv -f UTF-16 -t UTF-8 FILE)"),
    (b"\xfe\xff", 0, "UTF-16 text", "convert it to UTF-8 first (iconv -f UTF-16 -t UTF-8 FILE)"),
)


@dataclass(frozen=True)
class Container:
    """How to open a file: ``compression`` ("" = plain) and ``columnar`` ("parquet" | "arrow" | "")."""

    compression: str = ""
    columnar: str = ""
    inner_name: str = ""
    """The file name without its compression suffix (``c4.jsonl.gz`` → ``c4.jsonl``): names the text format."""


def compression_of(head: bytes) -> str:
    """The compression whose magic number starts ``head`` ("" for none)."""
    for magic, name in _COMPRESSED_MAGIC:
        if head.startswith(magic):
            return name
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] in _BZIP2_BLOCK:
        return "bzip2"
    if len(head) >= 4 and 0x50 <= head[0] <= 0x5F and head[1:4] == _ZSTD_SKIPPABLE:
        return "zstd"  # a skippable frame first: pzstd writes one before each frame (RFC 8878, 3.1.2)
    return ""


def _columnar_of(path: str, head: bytes) -> str:
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1") or (head.startswith(b"\xff\xff\xff\xff") and Path(path).suffix == ".arrow"):
        return "arrow"
    return ""


_CONTROL = bytes(range(9)) + bytes(range(14, 27)) + bytes(range(28, 32)) + b"\x7f"
"""Bytes that text does not contain (tab, newlines, form feed and escape are allowed)."""


def _not_text(path: str, head: bytes, where: str = "") -> None:
    """Raise ValueError when ``head`` (a file's first bytes) is not text: a known magic number, or NUL bytes among
    more than 5% control bytes (a text file with a stray NUL byte stays text: its line is skipped and counted)."""
    for magic, offset, what, advice in _NOT_TEXT:
        if head[offset:offset + len(magic)] == magic:
            raise ValueError(f"{path}{where} is {what}, not UTF-8 text; {advice}")
    nul = head.count(0)
    control = len(head) - len(head.translate(None, _CONTROL))
    if nul and control * 20 > len(head):
        raise ValueError(f"{path}{where} is a binary file ({nul} NUL bytes and {control - nul} other control bytes "
                         f"in its first {len(head)} bytes), not UTF-8 text; remove it from the inputs")


def identify(path: str) -> Container:
    """What ``path`` holds (see ``Container``); ValueError, saying what the file is and what to do, for binary
    files, archives, unsupported compressions, and columnar files inside a compressed stream."""
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
    name = Path(path).name
    columnar = _columnar_of(path, head)
    if columnar:
        return Container(columnar=columnar, inner_name=name)
    compression = compression_of(head)
    if not compression:
        _not_text(path, head)
        return Container(inner_name=name)
    suffix = Path(path).suffix.lower()
    inner = name[:-len(suffix)] if COMPRESSIONS.get(suffix) == compression else name
    with open_stream(path, compression) as f:
        inner_head = read_or_raise(path, compression, f.read, HEAD_BYTES)
    if _columnar_of(inner, inner_head) or compression_of(inner_head):
        raise ValueError(f"{path} is a {compression}-compressed parquet/arrow/compressed file; decompress it first "
                         f"(parquet and arrow files compress their columns themselves)")
    _not_text(path, inner_head, f" (after {compression} decompression)")
    return Container(compression=compression, inner_name=inner)


class _ZstdRaw(io.RawIOBase):
    """A zstd stream of one or more frames; EOFError when the file ends inside a frame (``zstandard``'s own
    stream reader returns a truncated file's bytes without an error)."""

    def __init__(self, f: BinaryIO) -> None:
        import zstandard

        self._f, self._dctx = f, zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False
        self._buf, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._pos >= len(self._buf):
            data = self._f.read(1 << 17)
            if not data:
                if self._in_frame:
                    raise EOFError("the zstd stream ended inside a frame")
                return 0
            out = []
            while data:
                self._in_frame = True
                out.append(self._obj.decompress(data))
                if self._obj.eof:  # a frame ended: what follows starts the next one
                    data = self._obj.unused_data
                    self._obj = self._dctx.decompressobj()
                    self._in_frame = False
                else:
                    data = b""
            self._buf, self._pos = b"".join(out), 0
        n = min(len(b), len(self._buf) - self._pos)
        b[:n] = self._buf[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def open_stream(path: str, compression: str) -> BinaryIO:
    """``path`` opened for binary reading through its decompressor (``compression`` "" = plain file); the object
    has ``readline(size)``. Read through ``read_or_raise`` (or catch ``STREAM_ERRORS``) to name a bad stream."""
    if not compression:
        return open(path, "rb")
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "bzip2":
        return bz2.open(path, "rb")
    if compression == "xz":
        return lzma.open(path, "rb")
    if compression == "zstd":
        return io.BufferedReader(_ZstdRaw(open(path, "rb")), buffer_size=1 << 16)
    raise ValueError(f"unknown compression {compression!r}")


def _stream_errors() -> tuple[type[BaseException], ...]:
    # OSError: bz2 raises a bare OSError("Invalid data stream") for a corrupt block (gzip's BadGzipFile is one).
    errors: list[type[BaseException]] = [OSError, EOFError, zlib.error, lzma.LZMAError]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:  # pragma: no cover - a dependency; only zstd files need it
        pass
    return tuple(errors)


STREAM_ERRORS = _stream_errors()
"""What decompressors raise on a truncated or corrupt stream: EOFError, zlib/lzma/zstd errors, and OSError (bz2's
bad data; gzip's). OSError also covers a failing disk: catch it around reads of the opened stream only (not
``open``), and let a plain file's through (``read_or_raise``) or word it as ``stream_error`` does."""


def stream_error(path: str, compression: str, e: BaseException) -> ValueError:
    """The user-facing error for a truncated or corrupt compressed stream; for ``compression`` "" (a plain file
    that could not be read) in words that do not blame a stream."""
    if not compression:
        return ValueError(f"{path} could not be read ({e}); check the disk or copy the file again, then run again")
    return ValueError(f"{path}: the {compression} stream is truncated or corrupt ({e}); re-download or re-compress "
                      f"the file (test it with the {compression} tool), then run again")


def read_or_raise(path: str, compression: str, read, *args):
    """``read(*args)`` on a decompressing stream, with a truncated/corrupt stream turned into ``stream_error``; a
    plain file's errors pass unchanged."""
    try:
        return read(*args)
    except STREAM_ERRORS as e:
        if not compression:
            raise
        raise stream_error(path, compression, e) from None
