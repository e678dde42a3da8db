"""Tool calls: how tools reach the prompt through (or beside) the chat template, and how each model
family writes its calls."""
