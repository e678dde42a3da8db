"""The APIs the gateway speaks: OpenAI's chat and text completions and Responses, Anthropic's
Messages, and session signals. Each API's request shape, its translation into a chat request,
and the wire that writes its answers and streamed events; their errors in each API's own shape."""
