"""Images in chat messages (OpenAI's `image_url` parts): read from a data URL or fetched over
HTTP(S), processed for the vision tower off the event loop, and their tokens expanded in the
prompt where the chat template wrote one placeholder per image."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from deltaserve.models.vision.positions import ImageInputs, expand_image_tokens
from deltaserve.models.vision.processor import (
    ImageProcessor,
    decode_image,
    image_from_base64,
    image_from_data_url,
)

from ..errors import bad_request

FETCH_TIMEOUT_S = 10.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT is 5 s
MAX_IMAGE_BYTES = 32 << 20


@dataclass
class ImageReader:
    """What the HTTP process does with a prompt's images: `refusal` says why it cannot (a text
    model, or a tower not loaded), else its processor reads them."""

    processor: ImageProcessor | None = None
    image_token_id: int | None = None
    limit: int | None = None  # --limit-mm-per-prompt's "image": the most a prompt may carry
    refusal: str = "this server reads text only"

    @classmethod
    def from_model_info(cls, info: dict[str, Any], limit: int | None) -> ImageReader:
        images = info.get("images") or {}
        if "processor" not in images:
            return cls(refusal=images.get("refusal", "this server reads text only"))
        sizes = {k: tuple(v) if isinstance(v, list) else v for k, v in images["processor"].items()}
        return cls(ImageProcessor(**sizes), int(images["image_token_id"]), limit)  # type: ignore[arg-type]

    def check(self, count: int, where: str) -> None:
        """A 400 when the prompt carries images this server cannot read, or more than its limit."""
        if count and self.processor is None:
            # no part type named: the Messages and Responses APIs call their image parts otherwise
            raise bad_request(f"{where}: images are not supported: {self.refusal}", where)
        if self.limit is not None and count > self.limit:
            raise bad_request(
                f"the prompt has {count} images; this server takes at most {self.limit} a prompt "
                "(--limit-mm-per-prompt)",
                where,
            )

    def check_placeholders(self, prompt_ids: list[int], images: int, where: str) -> None:
        """A 400 when the prompt holds more of the image placeholder token than it has images (a
        vision model's): a message's text or a prompt's ids that hold one would take an image's
        place, or go to the model as a token it never read as text."""
        if self.image_token_id is None:
            return
        found = prompt_ids.count(self.image_token_id)
        if found > images:
            raise bad_request(
                f"the prompt holds {found} image placeholder token(s) (id {self.image_token_id}) for "
                f"{images} image(s): a placeholder stands for an image sent beside the prompt (an "
                "image part, /generate's image_data), and text or token ids may not hold one",
                where,
            )

    async def read(
        self, urls: list[str], where: str = "messages", named: str | None = None
    ) -> ImageInputs | None:
        """The images at `urls` (data: or http(s):; SGLang's `image_data` also bare base64),
        processed (None for none); a 400 at `named` (else `where`) when this server reads no images
        or fewer, and at `where` naming one that fails."""
        if not urls:
            return None
        self.check(len(urls), named or where)
        images = await asyncio.gather(*(self._load(i, url, where) for i, url in enumerate(urls)))
        assert self.processor is not None
        try:
            return await asyncio.get_running_loop().run_in_executor(None, self.processor, list(images))
        except ValueError as exc:
            raise bad_request(f"an image could not be used: {exc}", where) from exc

    async def _load(self, index: int, url: str, where: str) -> Any:
        try:
            if url.startswith("data:"):
                return image_from_data_url(url)
            if url.startswith(("http://", "https://")):
                return decode_image(await fetch(url))
            if where == "image_data" and "://" not in url:  # SGLang's: bare base64
                return image_from_base64(url, "image_data's base64 (a data: URL, an http(s): URL or base64)")
            raise ValueError("an image URL must be a data: URL or an http(s): URL")
        except ValueError as exc:
            raise bad_request(f"image {index}: {exc}", where) from exc

    def expand(self, prompt_ids: list[int], inputs: ImageInputs, where: str = "messages") -> list[int]:
        """The prompt with each image's placeholder repeated to its tokens; a 400 where the chat
        template did not write one placeholder per image."""
        assert self.processor is not None and self.image_token_id is not None
        try:
            return expand_image_tokens(prompt_ids, self.image_token_id, self.processor.num_tokens(inputs))
        except ValueError as exc:
            raise bad_request(f"{exc}: does the chat template write images?", where) from exc


async def fetch(url: str) -> bytes:
    """The URL's bytes within FETCH_TIMEOUT_S in all (httpx's timeout bounds each read alone: a
    host that trickles bytes would hold the request open for good)."""
    try:
        return await asyncio.wait_for(_fetch(url), FETCH_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ValueError(f"fetching {url} took over {FETCH_TIMEOUT_S:g} s") from None


async def _fetch(url: str) -> bytes:
    import httpx

    try:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=True) as client:
            async with client.stream("GET", url) as reply:
                if reply.status_code != 200:
                    raise ValueError(f"fetching {url} gave HTTP {reply.status_code}")
                data = bytearray()
                async for piece in reply.aiter_bytes():
                    data += piece
                    if len(data) > MAX_IMAGE_BYTES:
                        raise ValueError(f"{url} is larger than {MAX_IMAGE_BYTES >> 20} MiB")
                return bytes(data)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL is no HTTPError: "http://[::1"
        raise ValueError(f"fetching {url} failed ({type(exc).__name__}: {exc})") from exc
