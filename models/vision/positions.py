"""Where an image sits in a prompt, and the text model's 3-D (M-RoPE) positions for it.

Qwen3.5 rotates each query / key channel by one of three positions: time, row or column
(`mrope_section`, interleaved t, h, w, t, h, w, ...). Text has the same value in all three,
which is plain RoPE; an image's tokens take (start, start + row, start + column) over its merged
grid, and the text after it continues from the largest of them plus one. From there on every
position is the token's index plus one offset (`delta`), so decode steps stay one-dimensional."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class ImageInputs:
    """A prompt's images as the vision tower reads them (`models/vision/processor.py`)."""

    pixel_values: torch.Tensor  # [patches, C * T * P * P] fp32
    grids: list[tuple[int, int, int]]  # each image's (t, h, w) in patches
    hashes: list[str]  # each image's digest: the prefix cache tells images apart by it

    def num_tokens(self, merge: int) -> list[int]:
        return [t * h * w // (merge * merge) for t, h, w in self.grids]


@dataclass
class ImagePrompt:
    """What a request with images carries through the engine."""

    inputs: ImageInputs
    positions: np.ndarray  # [3, prompt length] int64
    delta: int  # past the prompt, position = index + delta
    token_index: np.ndarray  # the prompt indices of the image tokens, in order
    cache_ids: list[int]  # the prompt with each image's tokens named by its digest (radix keys)
    embeds: torch.Tensor | None = field(default=None, repr=False)  # the tower's, one row per image token

    def positions_of(self, start: int, end: int) -> np.ndarray:
        """`[3, end - start]` positions of tokens start..end (prompt or generated)."""
        n = self.positions.shape[1]
        head = self.positions[:, start : min(end, n)]
        if end <= n:
            return head
        tail = np.arange(max(start, n), end, dtype=np.int64) + self.delta
        return np.concatenate([head, np.broadcast_to(tail, (3, tail.shape[0]))], axis=1)

    def image_rows(self, start: int, end: int) -> tuple[np.ndarray, int, int]:
        """The image tokens among start..end: their indices less `start`, and the range of
        `embeds` rows they read."""
        lo, hi = np.searchsorted(self.token_index, [start, end])
        return self.token_index[lo:hi] - start, int(lo), int(hi)


def image_prompt(prompt: list[int], inputs: ImageInputs, image_token_id: int, merge: int) -> ImagePrompt:
    """The prompt's M-RoPE positions and image spans; a prompt whose image tokens do not match
    its images (count, or one image's tokens not together) is a ValueError."""
    ids = np.asarray(prompt, dtype=np.int64)
    token_index = np.flatnonzero(ids == image_token_id)
    sizes = inputs.num_tokens(merge)
    if token_index.shape[0] != sum(sizes):
        raise ValueError(
            f"the prompt has {token_index.shape[0]} image tokens but its {len(sizes)} image(s) take {sum(sizes)}"
        )
    positions = np.empty((3, ids.shape[0]), dtype=np.int64)
    cache_ids = list(prompt)
    at = current = 0
    k = 0
    for (t, h, w), size, digest in zip(inputs.grids, sizes, inputs.hashes):
        start = int(token_index[k])
        if token_index[k + size - 1] != start + size - 1:
            raise ValueError("an image's tokens must be consecutive in the prompt")
        positions[:, at:start] = np.arange(start - at) + current
        current += start - at
        gh, gw = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        positions[:, start : start + size] = np.stack([tt, hh, ww]).reshape(3, -1) + current
        current += max(gh, gw)
        # ids no token has: the radix cache tells this image's tokens from another image's
        cache_ids[start : start + size] = digest_ids(digest, size)
        at, k = start + size, k + size
    positions[:, at:] = np.arange(ids.shape[0] - at) + current
    delta = int(positions.max()) + 1 - ids.shape[0] if ids.shape[0] else 0
    return ImagePrompt(inputs, positions, delta, token_index, cache_ids)


def digest_ids(digest: str, n: int) -> list[int]:
    """n negative ids from an image's digest: keys no text token shares."""
    base = int(digest[:15], 16)
    return [-1 - ((base + i) & 0x7FFFFFFFFFFF) for i in range(n)]


def expand_image_tokens(prompt: list[int], image_token_id: int, sizes: list[int]) -> list[int]:
    """A chat template's one image token per image, repeated to each image's number of tokens."""
    if prompt.count(image_token_id) != len(sizes):
        raise ValueError(
            f"the prompt has {prompt.count(image_token_id)} image placeholders for {len(sizes)} image(s)"
        )
    out: list[int] = []
    images = iter(sizes)
    for tok in prompt:
        out.extend([tok] * next(images) if tok == image_token_id else [tok])
    return out


def mrope_channels(config: Any, rotary_half: int) -> torch.Tensor | None:
    """For each rotated channel pair, which position it reads (0 time, 1 row, 2 column), by
    `mrope_section` interleaved; None for a model without M-RoPE."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    section = params.get("mrope_section")
    if not section:
        return None
    which = torch.zeros(rotary_half, dtype=torch.long)
    for axis in (1, 2):
        which[axis : 3 * section[axis] : 3] = axis
    return which


def rotate_3d(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, channels: torch.Tensor
) -> torch.Tensor:
    """Rotate-half RoPE of x `[T, H, D]`'s first `2 * len(inv_freq)` channels by 3-D positions
    `[3, T]`: channel pair j turns by positions[channels[j]] * inv_freq[j]."""
    angles = positions.float()[channels.to(x.device)].T * inv_freq.to(x.device)  # [T, rot / 2]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    rot_dim = emb.shape[-1]
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)
