"""When a request is done, and how much of its text may be shown while it runs."""

from __future__ import annotations

from deltaserve.engine.requests.request import Request

Verdict = tuple[str, int | str | None]  # (finish_reason, stop_reason)


def check_stop(req: Request, by_token: Verdict | None, max_model_len: int, checked: int) -> Verdict | None:
    """The finish reason after a token was appended, or None to go on; `by_token` is
    `stop_token_verdict`'s for that token (the caller needs it first, to keep its text out).

    `checked` is how much of the text was already searched for stop strings; a stop string
    found is trimmed from the text (kept with include_stop_str_in_output).
    """
    p = req.params
    n_out = len(req.output_token_ids)
    if by_token is not None:
        return by_token
    if n_out >= p.min_tokens:
        if p.stop:
            found = _find_stop_string(req, checked)
            if found is not None:
                return "stop", found
    if p.max_tokens is not None and n_out >= p.max_tokens:
        return "length", None
    if len(req.prompt_token_ids) + n_out >= max_model_len:  # tokens known: no placeholders
        return "length", None
    return None


def stop_token_verdict(req: Request, token: int, eos_token_ids: list[int]) -> Verdict | None:
    """("stop", reason) when `token`, just appended, is an end of sequence or one of the request's
    stop tokens and `min_tokens` are out; else None."""
    p = req.params
    if len(req.output_token_ids) < p.min_tokens:
        return None
    if not p.ignore_eos and token in eos_token_ids:
        return "stop", None
    if token in p.stop_token_ids:
        return "stop", token
    return None


def _find_stop_string(req: Request, checked: int) -> str | None:
    """The earliest stop string ending in the text added since `checked` characters (searched
    in the text's tail only: a stop string ending there starts at most `longest - 1`
    characters before it)."""
    detok = req.detokenizer
    longest = max(len(s) for s in req.params.stop)
    window_start = max(0, checked - longest + 1)
    region = detok.tail(detok.length - window_start)
    best: tuple[int, str] | None = None
    for s in req.params.stop:
        i = region.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return None
    i, s = best
    i += window_start
    detok.truncate(i + len(s) if req.params.include_stop_str_in_output else i)
    return s


def visible_length(req: Request) -> int:
    """How many characters are safe to show: while running, the tail that could still become a
    stop string is held. The shown text only ever grows: a stop string found later starts at or
    after the held tail."""
    length = req.detokenizer.length
    if req.finished or not req.params.stop:
        return length
    hold = max(len(s) for s in req.params.stop) - 1
    return max(0, length - hold)


def visible_text(req: Request) -> str:
    """The text safe to show (`visible_length` characters of it)."""
    text = req.detokenizer.text
    return text[: visible_length(req)]
