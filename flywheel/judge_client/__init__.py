"""Asking a model for a verdict: the judged text fenced in the prompt, and the endpoint asked."""
