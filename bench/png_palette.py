"""A screenshot's PNG rewritten with a palette of at most 256 colours, in the standard library
only: a page of text on flat colours has a few thousand colours (antialiased glyph edges), most
of them on a few pixels, so its most common 256 colours, each other colour drawn as the nearest
of those, look the same at a third of the size (one byte a pixel instead of three, then zlib
at level 9)."""

from __future__ import annotations

import struct
import zlib
from collections import Counter
from pathlib import Path

SIGNATURE = b"\x89PNG\r\n\x1a\n"
RGB, RGBA = 2, 6  # PNG colour types, 8 bits a sample


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    if not data.startswith(SIGNATURE):
        raise ValueError("not a PNG file")
    chunks, pos = [], len(SIGNATURE)
    while pos < len(data):
        (size,) = struct.unpack(">I", data[pos : pos + 4])
        chunks.append((data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + size]))
        pos += 12 + size
    return chunks


def _unfilter(raw: bytes, height: int, stride: int, bpp: int) -> list[bytes]:
    """The image's rows, each PNG row filter undone (None, Sub, Up, Average, Paeth)."""
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + prev[i]) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + prev[i]) // 2) & 255
            elif kind == 4:
                up, corner = prev[i], prev[i - bpp] if i >= bpp else 0
                guess = left + up - corner
                near_left, near_up = abs(guess - left), abs(guess - up)
                near_corner = abs(guess - corner)
                if near_left <= near_up and near_left <= near_corner:
                    line[i] = (line[i] + left) & 255
                elif near_up <= near_corner:
                    line[i] = (line[i] + up) & 255
                else:
                    line[i] = (line[i] + corner) & 255
        rows.append(bytes(line))
        prev = line
    return rows


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def palette_png(path: Path, colours: int = 256) -> bool:
    """Rewrite the 8-bit RGB (or opaque RGBA) PNG at `path` with a palette; False (the file
    left as it is) for any other kind of PNG, or when the result would not be smaller."""
    data = path.read_bytes()
    chunks = _chunks(data)
    width, height, depth, kind, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    if depth != 8 or kind not in (RGB, RGBA) or interlace:
        return False
    bpp = 3 if kind == RGB else 4
    raw = zlib.decompress(b"".join(body for name, body in chunks if name == b"IDAT"))
    rows = _unfilter(raw, height, width * bpp, bpp)
    if kind == RGBA:
        if any(row[i] != 255 for row in rows for i in range(3, len(row), 4)):
            return False
        rows = [bytes(b for i, b in enumerate(row) if i % 4 != 3) for row in rows]
    counts: Counter[bytes] = Counter(row[i : i + 3] for row in rows for i in range(0, width * 3, 3))
    palette = [colour for colour, _ in counts.most_common(colours)]
    index = {colour: n for n, colour in enumerate(palette)}
    for colour in counts:
        if colour not in index:
            index[colour] = min(
                range(len(palette)),
                key=lambda n: sum((a - b) ** 2 for a, b in zip(palette[n], colour, strict=True)),
            )
    pixels = bytearray()
    for row in rows:
        pixels.append(0)  # filter None: palette indices compress well as they are
        pixels.extend(index[row[i : i + 3]] for i in range(0, width * 3, 3))
    header = struct.pack(">IIBBBBB", width, height, 8, 3, 0, 0, 0)
    out = b"".join(
        [
            SIGNATURE,
            _chunk(b"IHDR", header),
            _chunk(b"PLTE", b"".join(palette)),
            _chunk(b"IDAT", zlib.compress(bytes(pixels), 9)),
            _chunk(b"IEND", b""),
        ]
    )
    if len(out) >= len(data):
        return False
    path.write_bytes(out)
    return True
