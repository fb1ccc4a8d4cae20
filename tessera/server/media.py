"""Images in requests: where their bytes may come from, and turning them into engine inputs.

Every API names an image by a URL once converted to the chat request (`ChatMessage.image_urls`):
a `data:` URL (base64) always; an `http(s)` URL only from a host in `--allowed-media-domains`
(none by default), and never from an address that is loopback, private, link-local or otherwise
not public, whatever the name resolves to (a client must not reach the server's own network
through it); redirects are not followed. A `file://` URL only under `--allowed-local-media-path`
(off by default). vLLM's flags, with the same defaults. The bytes then go through
`tessera/images.py` (format allow-list, pixel limit, processing) on a worker thread.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import os
import socket
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from tessera.errors import ConfigError
from tessera.images import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES, ImageLimits, image_input
from tessera.sampling_params import InvalidRequestError
from tessera.vision import ImageInput, VisionConfig

# Media types a data URL may declare (it may declare none: the bytes say what they are).
IMAGE_MEDIA_TYPES = frozenset({"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"})
MAX_FETCHED_BYTES = 16 * 1024 * 1024  # as the request body's own limit
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaSettings:
    """Where image bytes may come from, and what an image may be."""

    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: Optional[Path] = None
    limits: ImageLimits = field(default_factory=ImageLimits)

    def __post_init__(self) -> None:
        if self.allowed_local_path is not None and not self.allowed_local_path.is_dir():
            raise ConfigError(f"--allowed-local-media-path {self.allowed_local_path} is not a directory")

    @classmethod
    def from_args(cls, args: Any) -> "MediaSettings":
        local = getattr(args, "allowed_local_media_path", None)
        try:
            limits = ImageLimits(max_pixels=getattr(args, "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS),
                                 max_images=parse_mm_limit(getattr(args, "limit_mm_per_prompt", None)))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return cls(tuple(d.strip().lower() for d in (getattr(args, "allowed_media_domains", None) or []) if d.strip()),
                   Path(local).expanduser().resolve() if local else None, limits)


def parse_mm_limit(text: Optional[str]) -> int:
    """`--limit-mm-per-prompt`: `image=N` (vLLM's form; its JSON form `{"image": N}` too)."""
    if not text:
        return DEFAULT_MAX_IMAGES
    import json

    try:
        value = json.loads(text) if text.strip().startswith("{") else dict(
            part.split("=", 1) for part in text.split(","))
        kinds = {k.strip(): int(v) for k, v in value.items()}
    except (ValueError, TypeError, AttributeError):
        raise ConfigError(f"--limit-mm-per-prompt {text!r}: give image=N") from None
    unknown = set(kinds) - {"image"}
    if unknown:
        raise ConfigError(f"--limit-mm-per-prompt: only images are taken, not {', '.join(sorted(unknown))}")
    if kinds.get("image", DEFAULT_MAX_IMAGES) < 0:
        raise ConfigError("--limit-mm-per-prompt image=N must not be negative")
    return kinds.get("image", DEFAULT_MAX_IMAGES)


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 `data:` URL of an image (or of no declared type)."""
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise InvalidRequestError("an image data URL has no ',' before its data")
    parts = [p.strip().lower() for p in header.split(";")]
    if "base64" not in parts[1:]:
        raise InvalidRequestError("an image data URL must be base64 (data:image/png;base64,...)")
    media = parts[0]
    if media and media not in IMAGE_MEDIA_TYPES:
        raise InvalidRequestError(f"image media type {media!r} is not accepted; send PNG, JPEG, WebP or GIF")
    return decode_base64(payload)


def decode_base64(payload: str) -> bytes:
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("an image's base64 data is not valid base64") from None


def _public(host: str, port: int) -> None:
    """Refuse a host any of whose addresses is not a public one."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise InvalidRequestError(f"the image host {host!r} could not be resolved") from None
    for info in infos:
        addr = ipaddress.ip_address(info[4][0].split("%")[0])
        if not addr.is_global or addr.is_multicast:
            raise InvalidRequestError(f"the image host {host!r} is not a public address; it is not fetched")


async def _fetch(url: str, parsed: urllib.parse.ParseResult, settings: MediaSettings) -> bytes:
    host = (parsed.hostname or "").lower()
    if not host or host not in settings.allowed_domains:
        raise InvalidRequestError(
            "image URLs over http(s) are taken only from the hosts in this server's --allowed-media-domains"
            + (f"; {host!r} is not one of them" if settings.allowed_domains else " (none)")
            + "; send the image as a base64 data URL")
    await asyncio.to_thread(_public, host, parsed.port or (443 if parsed.scheme == "https" else 80))
    import httpx

    try:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=False, trust_env=False) as client:
            async with client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise InvalidRequestError(f"fetching the image gave HTTP {resp.status_code}")
                data = bytearray()
                async for chunk in resp.aiter_bytes():
                    data += chunk
                    if len(data) > MAX_FETCHED_BYTES:
                        raise InvalidRequestError(f"the image at the URL is larger than {MAX_FETCHED_BYTES} bytes")
                return bytes(data)
    except httpx.HTTPError:
        raise InvalidRequestError("the image URL could not be fetched") from None


def _read_local(parsed: urllib.parse.ParseResult, settings: MediaSettings) -> bytes:
    root = settings.allowed_local_path
    if root is None:
        raise InvalidRequestError("file:// image URLs are not taken by this server (--allowed-local-media-path)")
    path = Path(os.path.realpath(urllib.parse.unquote(parsed.path)))
    if parsed.netloc not in ("", "localhost") or not path.is_relative_to(root) or not path.is_file():
        raise InvalidRequestError("a file:// image URL must name a file under this server's "
                                  "--allowed-local-media-path")
    if path.stat().st_size > MAX_FETCHED_BYTES:
        raise InvalidRequestError(f"the image file is larger than {MAX_FETCHED_BYTES} bytes")
    return path.read_bytes()


async def image_bytes(url: str, settings: MediaSettings) -> bytes:
    """The bytes an image URL names, under the server's rules (InvalidRequestError otherwise)."""
    if not isinstance(url, str) or not url:
        raise InvalidRequestError("an image needs a URL")
    if url[:5].lower() == "data:":
        return decode_data_url(url)
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme in ("http", "https"):
        return await _fetch(url, parsed, settings)
    if parsed.scheme == "file":
        return await asyncio.to_thread(_read_local, parsed, settings)
    raise InvalidRequestError("an image URL must be a data: URL (or http(s) or file:// where the server allows them)")


async def load_images(urls: list[str], vision: Optional[VisionConfig], model: str,
                      settings: MediaSettings) -> list[ImageInput]:
    """A request's images as the engine takes them, in order; a 400 for a model without a vision
    side, too many images, or any image that breaks a rule."""
    if not urls:
        return []
    if vision is None:
        raise InvalidRequestError(f"the model `{model}` does not take images; it reads text only")
    limit = settings.limits.max_images
    if len(urls) > limit:
        raise InvalidRequestError(f"a prompt may hold at most {limit} images on this server "
                                  f"(--limit-mm-per-prompt image={limit}); this one has {len(urls)}")
    out = []
    for url in urls:
        data = await image_bytes(url, settings)
        out.append(await asyncio.to_thread(image_input, data, vision, settings.limits))
    return out


def image_token_text(tokenizer: Any, vision: VisionConfig) -> str:
    """The text of the model's image token, which a template without image parts gets."""
    return tokenizer.decode([vision.image_token_id], skip_special_tokens=False)


def template_reads_images(template: Optional[str]) -> bool:
    """Whether a chat template renders `{"type": "image"}` content parts (LLaVA's own do)."""
    return bool(template) and ("'image'" in template or '"image"' in template)


def images_as_text(messages: list[dict[str, Any]], token: str) -> list[dict[str, Any]]:
    """Messages whose content parts a template cannot read as text content: each image as the
    image token, all of a message's images before its text (LLaVA-1.5's own order)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            images = sum(1 for p in content if p.get("type") == "image")
            text = "\n".join(p["text"] for p in content if p.get("type") == "text")
            m = {**m, "content": (token + "\n") * images + text}
        out.append(m)
    return out
