"""Qwen3.5's vision tower: patches -> ViT blocks -> 2x2 merger, one embedding per image token.

Module and weight names follow the checkpoint's `model.visual.*`. Attention is bidirectional
within each frame of each image (torch's sdpa, one call per frame); everything else is plain
torch: the tower runs once per image, at the request's admission, not per step."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class PatchEmbed(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.shape = (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        kernel = self.shape[1:]
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one patch per row: the conv's kernel covers it whole, so it is one matmul
        w = self.proj.weight.flatten(1)
        return F.linear(x.to(w.dtype).view(x.shape[0], -1), w, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=True)
        self.proj = nn.Linear(hidden, hidden, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        outs = []
        start = 0
        for length in frames:  # each frame attends within itself
            part = slice(start, start + length)
            qs, ks, vs = (t[part].transpose(0, 1) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
            start += length
        return self.proj(torch.cat(outs).reshape(n, -1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in fp32 over the whole head, cos / sin `[N, D]`."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, inner, bias=True)
        self.linear_fc2 = nn.Linear(inner, hidden, bias=True)
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"
        if act not in ("gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"the vision tower's activation {act!r} is not supported")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """Each 2x2 block of neighbouring patches (consecutive rows, `patch_order`) -> one token."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """pixel rows `[patches, C * T * P * P]` of images with grids `(t, h, w)` (in patches) ->
    `[sum(t * h * w) / merge**2, out_hidden]`, the images' tokens in order."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.merge = int(cfg.spatial_merge_size)
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"the vision tower's RoPE {rope.get('rope_type')!r} is not supported")
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.side = int(cfg.num_position_embeddings**0.5)
        head = cfg.hidden_size // cfg.num_heads
        spatial = head // 2  # rows and columns each rotate half of the head
        inv_freq = 1.0 / (
            float(rope.get("rope_theta", 10000.0)) ** (torch.arange(0, spatial, 2).float() / spatial)
        )
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = Merger(cfg)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.patch_embed(pixels)
        rows, cols = patch_order(grids, self.merge, x.device)
        x = x + self.position_embeddings(grids, rows, cols).to(x.dtype)
        freqs = torch.cat((rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        frames = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        return self.merger(x)

    def position_embeddings(
        self, grids: list[tuple[int, int, int]], rows: torch.Tensor, cols: torch.Tensor
    ) -> torch.Tensor:
        """The learned square grid of position embeddings resampled to each image's grid
        (bilinear, corners aligned), read at each patch's row and column."""
        table = self.pos_embed.weight.float().T.reshape(1, -1, self.side, self.side)
        parts = []
        start = 0
        for t, h, w in grids:
            n = t * h * w
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
            parts.append(grid[:, rows[start : start + n].long(), cols[start : start + n].long()].T)
            start += n
        return torch.cat(parts)


def patch_order(
    grids: list[tuple[int, int, int]], merge: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch row's (row, column) in its image: the processor lays patches out block by block
    (each `merge` x `merge` block's patches consecutive, blocks in raster order), every frame alike."""
    rows, cols = [], []
    for t, h, w in grids:
        r = (
            torch.arange(h, device=device)
            .view(h // merge, merge, 1, 1)
            .expand(h // merge, merge, w // merge, merge)
        )
        c = (
            torch.arange(w, device=device)
            .view(1, 1, w // merge, merge)
            .expand(h // merge, merge, w // merge, merge)
        )
        rows.append(r.transpose(1, 2).reshape(-1).repeat(t))
        cols.append(c.transpose(1, 2).reshape(-1).repeat(t))
    return torch.cat(rows).float(), torch.cat(cols).float()
