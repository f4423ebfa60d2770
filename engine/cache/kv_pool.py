"""Pages of KV cache for the full-attention layers. Page 0 is the padding page."""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        # one allocation per entry (k, v, or an MLA latent), layer-major, at fixed addresses
        self.buffers = {
            name: torch.zeros(num_layers, num_pages, page_size, *shape, dtype=dtype, device=device)
            for name, shape in shapes.items()
        }
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        return {name: buf[index] for name, buf in self.buffers.items()}

    def bytes_per_page(self) -> int:
        return sum(b[:, 0].numel() * b.element_size() for b in self.buffers.values())
