"""Engine Logprobs -> OpenAI's two logprob shapes (chat `content[]` and the legacy completions one)."""

from __future__ import annotations

import codecs
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from ..protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    SamplingRequest,
    TokenLogprob,
    TopLogprob,
)

if TYPE_CHECKING:
    from deltaserve.engine.requests.outputs import Logprob


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2 byte-level BPE spells each byte as one printable character; inverting that map gives a
    # token's exact bytes, even for tokens that hold only part of a UTF-8 character.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenText:
    """Token id -> (text, bytes) for one tokenizer, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id) if self.tokenizer is not None else None
        if piece is None:
            return f"<|token_{token_id}|>", list(f"<|token_{token_id}|>".encode())
        decoder = _byte_decoder()
        if all(ch in decoder for ch in piece) and piece not in self.tokenizer.all_special_tokens:
            raw = bytes(decoder[ch] for ch in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        return piece, list(piece.encode("utf-8"))


class TokenIds(TokenText):
    """vLLM's `return_tokens_as_token_ids`: each token as `token_id:N`, whatever it decodes to."""

    def __init__(self) -> None:
        super().__init__(None)

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        text = f"token_id:{token_id}"
        return text, list(text.encode())


_TOKEN_IDS = TokenIds()


def token_text_for(req: SamplingRequest, token_text: TokenText) -> TokenText:
    """How a request's logprobs name tokens: their text, or their ids where it asks."""
    return _TOKEN_IDS if req.return_tokens_as_token_ids else token_text


def _top(lp: Logprob, k: int) -> list[tuple[int, float]]:
    return sorted(lp.top.items(), key=lambda kv: -kv[1])[:k]


def _asked(lp: Logprob) -> list[tuple[int, float]]:
    """vLLM's top logprobs under `logprob_token_ids`: the chosen token, then each asked id once."""
    return [(lp.token_id, lp.logprob)] + [(t, v) for t, v in lp.asked.items() if t != lp.token_id]


def _legacy_top(lp: Logprob, top_k: int, token_text: TokenText, asked: bool = False) -> dict[str, float]:
    """A legacy completion's `top_logprobs` entry: the top `top_k` and the chosen token, which
    OpenAI's and vLLM's always add (up to `top_k + 1` entries); with `asked`, the chosen token
    and the `logprob_token_ids`' ones."""
    top = {token_text(t)[0]: v for t, v in (_asked(lp) if asked else _top(lp, top_k))}
    top.setdefault(token_text(lp.token_id)[0], lp.logprob)
    return top


def chat_logprobs(
    logprobs: list[Logprob], top_k: int, token_text: TokenText, asked: bool = False
) -> ChatLogprobs:
    """Chat's `content[]`; each token's `top_logprobs` are its top `top_k`, or with `asked` (the
    request's `logprob_token_ids`) the chosen token and the asked ones, as vLLM's are."""
    content = []
    for lp in logprobs:
        text, raw = token_text(lp.token_id)
        tops = []
        for token_id, value in _asked(lp) if asked else _top(lp, top_k):
            t_text, t_raw = token_text(token_id)
            tops.append(TopLogprob(token=t_text, logprob=value, bytes=t_raw))
        content.append(TokenLogprob(token=text, logprob=lp.logprob, bytes=raw, top_logprobs=tops))
    return ChatLogprobs(content=content)


class TextOffsets:
    """The legacy logprobs' `text_offset`: where each token's text starts in a choice's text, the
    characters that the tokens before it have completed. A token holding part of a character
    starts where that character does, so offsets never go back and stay within the text (a sum
    of the tokens' own strings counts a U+FFFD for each such part)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.length = 0

    def take(self, raw: list[int]) -> int:
        """The offset of the token whose bytes are `raw`, then past it."""
        start = self.length
        self.length += len(self._decoder.decode(bytes(raw)))
        return start

    def restore(self, saved: TextOffsets) -> None:
        """Go on from where `saved` stands: its length, and the part of a character it holds."""
        self.length = saved.length
        self._decoder.setstate(saved._decoder.getstate())


def completion_logprobs(
    logprobs: list[Logprob], top_k: int, token_text: TokenText, offsets: TextOffsets, asked: bool = False
) -> CompletionLogprobs:
    """Generated tokens' logprobs; `offsets` is the choice's, past any text before them; `asked`:
    the request's `logprob_token_ids` stand in for the top ones."""
    out = CompletionLogprobs()
    for lp in logprobs:
        text, raw = token_text(lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append(_legacy_top(lp, top_k, token_text, asked))
        out.text_offset.append(offsets.take(raw))
    return out


def prompt_completion_logprobs(
    prompt_ids: list[int],
    token_text: TokenText,
    scored: list[Logprob | None] | None,
    top_k: int,
    offsets: TextOffsets,
) -> CompletionLogprobs:
    """Echoed prompt tokens with the log-probability of each given those before it (`scored`, from
    the engine's prefill); the first token's is null, as OpenAI's and vLLM's are."""
    out = CompletionLogprobs()
    for i, token_id in enumerate(prompt_ids):
        text, raw = token_text(token_id)
        lp = scored[i] if scored is not None and i < len(scored) else None
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob if lp is not None else None)
        out.top_logprobs.append(_legacy_top(lp, top_k, token_text) if lp is not None else None)
        out.text_offset.append(offsets.take(raw))
    return out


def vllm_prompt_logprobs(
    scored: list[Logprob | None] | None, top_k: int, token_text: TokenText
) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` reply field: per prompt position (the first None) the prompt's token
    and the top `top_k` candidates, keyed by token id."""
    if scored is None:
        return None
    out: list[dict[str, PromptLogprob] | None] = []
    for lp in scored:
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(lp.token_id): PromptLogprob(
                logprob=lp.logprob, rank=lp.rank, decoded_token=token_text(lp.token_id)[0]
            )
        }
        for rank, (token_id, value) in enumerate(_top(lp, top_k), start=1):
            entry.setdefault(
                str(token_id), PromptLogprob(logprob=value, rank=rank, decoded_token=token_text(token_id)[0])
            )
        out.append(entry)
    return out
