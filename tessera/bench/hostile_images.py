"""Hostile images for `tessera bench hostile` and the tests: each a URL (or Ollama/Anthropic base64)
a client may send, and each one a server must answer with a 4xx, never a 5xx, a hang or a crash.

Decompression bombs are written by hand (a PNG header claiming a vast canvas, and IDAT data of
zeros that deflate compresses a thousandfold), so building the corpus never holds the pixels.
"""
from __future__ import annotations

import base64
import io
import struct
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_header(width: int, height: int, idat: bytes = b"", bit_depth: int = 1, color: int = 0) -> bytes:
    """A PNG of any claimed size (1-bit grey by default) with the given IDAT payload."""
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def png_bomb(side: int = 30_000) -> bytes:
    """A valid 1-bit PNG of side x side zeros: about side^2 / 8000 bytes on the wire."""
    row = b"\x00" * (1 + (side + 7) // 8)
    z = zlib.compressobj(9)
    parts = [z.compress(row) for _ in range(side)]
    return png_header(side, side, b"".join(parts) + z.flush())


def gif_huge_canvas() -> bytes:
    """A GIF whose logical screen claims 65,535 x 65,535 pixels."""
    return (b"GIF89a" + struct.pack("<HH", 65535, 65535) + b"\x80\x00\x00" + b"\x00\x00\x00\xff\xff\xff"
            + b",\x00\x00\x00\x00" + struct.pack("<HH", 65535, 65535) + b"\x00\x02\x02D\x01\x00;")


def small_image(fmt: str = "PNG", size: tuple[int, int] = (24, 20)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 90)).save(buf, format=fmt)
    return buf.getvalue()


SVG = (b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><script>alert(1)</script>'
       b'<image href="file:///etc/passwd"/></svg>')


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def hostile_image_urls() -> list[tuple[str, str]]:
    """(name, URL) of images every server must refuse with a 4xx (none is taken by default)."""
    png = small_image()
    return [
        ("image: decompression bomb (30,000^2 PNG)", data_url(png_bomb())),
        ("image: 6,000^2 PNG over the pixel limit", data_url(png_bomb(6_000))),
        ("image: PNG header claiming 2^31 - 1 square", data_url(png_header(2**31 - 1, 2**31 - 1))),
        ("image: PNG of zero width", data_url(png_header(0, 10))),
        ("image: GIF canvas 65,535^2", data_url(gif_huge_canvas(), "image/gif")),
        ("image: truncated PNG", data_url(png[:len(png) // 2])),
        ("image: truncated JPEG", data_url(small_image("JPEG")[:120], "image/jpeg")),
        ("image: PNG with corrupt pixel data", data_url(png_header(16, 16, b"\x78\x9c" + b"\xff" * 40))),
        ("image: text bytes", data_url(b"hello, I am not an image")),
        ("image: SVG by media type", data_url(SVG, "image/svg+xml")),
        ("image: SVG bytes as PNG", data_url(SVG)),
        ("image: BMP (not allowed)", data_url(small_image("BMP"), "")),
        ("image: TIFF (not allowed)", data_url(small_image("TIFF"), "")),
        ("image: empty data", "data:image/png;base64,"),
        ("image: bad base64", "data:image/png;base64,!!!not*base64???"),
        ("image: data URL without base64", "data:image/png,rawbytes"),
        ("image: data URL without a comma", "data:image/png;base64"),
        ("image: http host not allowed", "http://example.com/cat.png"),
        ("image: cloud metadata address", "http://169.254.169.254/latest/meta-data/"),
        ("image: file outside the allowed path", "file:///etc/passwd"),
        ("image: file path escaping upwards", "file:///tmp/../etc/passwd"),
        ("image: ftp URL", "ftp://example.com/cat.png"),
        ("image: javascript URL", "javascript:alert(1)"),
    ]
