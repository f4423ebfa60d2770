"""Chat messages to prompt text and generated text back to OpenAI's parts: the chat template
(`chat_template.py`), and one choice's text split into reasoning, content and tool calls
(`chat_output.py`, over the `<think>` split in `reasoning.py` and the tool-call parsers in
`tool_calls.py`)."""
