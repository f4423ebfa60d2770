"""The OpenAI endpoints from request to response: `chat.py`, `completions.py` and `responses.py`
(the Responses API over the chat path), the flow they share (`generation.py`), what every handler
needs (`context.py`), request fields to `SamplingParams` (`request_params.py`) and the engine's
log-probabilities in OpenAI's shapes (`logprobs.py`)."""
