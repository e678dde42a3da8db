"""The serve loop: OpenAI-compatible gateway, embedded engine, turn recording, hot weight swaps."""
