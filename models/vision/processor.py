"""An image as Qwen3.5's vision tower reads it: resized to whole merged patches within the
checkpoint's pixel bounds, normalized, and cut into patch rows (each 2x2 block of patches
consecutive), as transformers' PIL image processor for these models does (Qwen2VL's)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltaserve.models.vision.positions import ImageInputs


@dataclass(frozen=True)
class ImageProcessor:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_checkpoint(cls, path: str, vision_config: Any) -> ImageProcessor:
        """The checkpoint's preprocessor_config.json, else the vision config's sizes and Qwen3.5's defaults."""
        raw: dict[str, Any] = {}
        file = os.path.join(path, "preprocessor_config.json")
        if os.path.isfile(file):
            with open(file) as f:
                raw = json.load(f)
        size = raw.get("size") or {}
        default = cls()
        return cls(
            patch_size=int(raw.get("patch_size") or vision_config.patch_size),
            temporal_patch_size=int(raw.get("temporal_patch_size") or vision_config.temporal_patch_size),
            merge_size=int(raw.get("merge_size") or vision_config.spatial_merge_size),
            min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or default.min_pixels),
            max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or default.max_pixels),
            mean=tuple(raw.get("image_mean") or default.mean),  # type: ignore[arg-type]
            std=tuple(raw.get("image_std") or default.std),  # type: ignore[arg-type]
        )

    def num_tokens(self, inputs: ImageInputs) -> list[int]:
        return inputs.num_tokens(self.merge_size)

    def __call__(self, images: list[Any]) -> ImageInputs:
        """PIL images -> the tower's inputs; a ValueError for an image it cannot take."""
        rows, grids, hashes = [], [], []
        for image in images:
            patches, grid = self.patches(image)
            rows.append(patches)
            grids.append(grid)
            hashes.append(hashlib.sha256(patches.tobytes() + repr(grid).encode()).hexdigest())
        return ImageInputs(torch.from_numpy(np.concatenate(rows)), grids, hashes)

    def patches(self, image: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
        from PIL import Image

        image = to_rgb(image)
        factor = self.patch_size * self.merge_size
        height, width = self.resized(image.height, image.width, factor)
        image = image.resize((width, height), Image.Resampling.BICUBIC)
        pixels = np.asarray(image, dtype=np.float32) / np.float32(255.0)
        x = (pixels - np.asarray(self.mean, dtype=np.float32)) / np.asarray(self.std, dtype=np.float32)
        c, p, m = 3, self.patch_size, self.merge_size
        gh, gw = height // p, width // p
        x = x.transpose(2, 0, 1).reshape(c, gh // m, m, p, gw // m, m, p)
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (block row, block col, row, col, channel, py, px)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], self.temporal_patch_size, p, p))
        return np.ascontiguousarray(x.reshape(gh * gw, -1)), (1, gh, gw)

    def resized(self, height: int, width: int, factor: int) -> tuple[int, int]:
        """The size nearest the image's aspect in whole `factor`s, within the pixel bounds."""
        if min(height, width) < 1 or max(height, width) / min(height, width) > 200:
            raise ValueError(f"an image of {width} x {height} pixels: its aspect ratio must be under 200")
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w


def to_rgb(image: Any) -> Any:
    """The image in RGB, transparency laid over white (as transformers' `convert_to_rgb` and vLLM
    read it; PIL's own conversion would drop the alpha and show what is under it, often black)."""
    from PIL import Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def decode_image(data: bytes) -> Any:
    """Image file bytes (PNG, JPEG, WebP, ...) as a PIL image; a ValueError for anything else,
    an image past PIL's pixel limit (a decompression bomb) included."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"the image could not be read ({exc})") from exc
    return image


def image_from_data_url(url: str) -> Any:
    """A `data:image/...;base64,...` URL's image."""
    head, _, body = url.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64"):
        raise ValueError("an image data URL must be data:<type>;base64,<data>")
    return image_from_base64(body, "the image data URL's base64")


def image_from_base64(data: str, what: str = "the image's base64") -> Any:
    """Base64-encoded image file bytes as a PIL image; a ValueError naming `what` when invalid."""
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{what} is invalid ({exc})") from exc
    return decode_image(raw)


def load_image(url: str) -> Any:
    """A `data:` URL's image, or an `http(s):` URL's, fetched (the offline `LLM.chat`'s; the
    server fetches without blocking its loop)."""
    if url.startswith("data:"):
        return image_from_data_url(url)
    if not url.startswith(("http://", "https://")):
        raise ValueError("an image URL must be a data: URL or an http(s): URL")
    import httpx

    try:
        reply = httpx.get(url, timeout=10.0, follow_redirects=True)
        reply.raise_for_status()
    except httpx.HTTPError as exc:
        raise ValueError(f"fetching {url} failed ({exc})") from exc
    return decode_image(reply.content)
