"""From a request to prompt token ids: the chat template (with tools) rendered once, tokenized once,
continuing the exact ids of the session's previous turn where the text allows."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flywheel.formats.tool_calls import FORMATS, HERMES, ToolFormat, detect
from flywheel.serve.api.chat import ChatCompletionRequest, CompletionRequest
from flywheel.serve.api.errors import APIError
from flywheel.serve.api.sessions import SessionInfo
from flywheel.serve.continuation import SessionContinuations
from flywheel.serve.tools.template import adapt_messages, template_support


class PromptBuilder:
    """Chat messages (and tools) to prompt token ids, through the model's chat template; a
    session's prompt continues the exact ids of its previous turn where its text does.

    Rendering and tokenizing run on a thread of their own, not on the event loop: an agent's
    prompt of tens of thousands of tokens takes tens of milliseconds (29 k tokens of SmolLM2:
    34 ms, mostly tokenizing), during which the loop goes on streaming other answers (the GIL is
    shared, so this spreads the work out rather than adding CPU)."""

    def __init__(self, tokenizer: Any, continuations: SessionContinuations, tool_format: str = "auto"):
        self.tokenizer = tokenizer
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompts")
        self.continuations = continuations
        self.renders_tools, self.renders_calls = template_support(tokenizer)
        if not self.renders_tools:
            self.tool_format = HERMES  # the gateway writes the tool prompt, in its format
        else:
            self.tool_format = detect(tokenizer.chat_template) if tool_format == "auto" else FORMATS[tool_format]

    def close(self) -> None:
        """End the rendering thread, once what is queued on it is rendered (call it after the
        server stopped taking requests: nothing is then)."""
        self._thread.shutdown(wait=True)

    async def chat(self, body: ChatCompletionRequest, session: SessionInfo) -> tuple[list[int], str, str, ToolFormat | None]:
        """(prompt ids, the text they stand for, the answer's forced start: a forced tool call's
        prefix, else the served memory's opening (`SessionInfo.opening`), the tool-call format when
        tools are active)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._chat, body, session)

    async def completion(self, body: CompletionRequest, session: SessionInfo) -> tuple[list[int], str | None]:
        """(prompt ids, the text they stand for: None for a prompt given as ids)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._completion, body, session)

    def _chat(self, body: ChatCompletionRequest, session: SessionInfo) -> tuple[list[int], str, str, ToolFormat | None]:
        tools = None
        if body.tools and body.tool_choice != "none":
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
        messages = adapt_messages([m.for_template() for m in body.messages], tools, self.renders_tools, self.renders_calls)
        try:
            text = self._render(messages, tools)
        except Exception as exc:
            merged = _system_first(messages)
            if merged is None:  # the template rejected this conversation
                raise APIError(400, f"messages cannot be rendered by the chat template: {exc}", "messages") from None
            try:  # a template that takes one system message, first: the later ones join it
                text = self._render(merged, tools)
            except Exception:
                raise APIError(400, f"messages cannot be rendered by the chat template: {exc}", "messages") from None
        forced = self.tool_format.forced_prefix(body.tool_choice) if tools else session.opening
        active = self.tool_format if tools else None
        return self.continuations.encode(session.session_id, text + forced), text + forced, forced, active

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools if self.renders_tools else None, add_generation_prompt=True, tokenize=False
        )

    def _completion(self, body: CompletionRequest, session: SessionInfo) -> tuple[list[int], str | None]:
        if isinstance(body.prompt, str):
            return self.continuations.encode(session.session_id, body.prompt), body.prompt
        vocab = len(self.tokenizer)
        if not all(0 <= t < vocab for t in body.prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(body.prompt), None


def _system_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation with every system message after the first appended to the first (None
    when there is no later one): what templates that take a single leading system message can
    render. Appending keeps the history append-only as long as no new one arrives."""
    later = [i for i, m in enumerate(messages) if m.get("role") == "system" and i > 0]
    if not later:
        return None
    texts = [str(messages[i].get("content") or "") for i in later]
    rest = [m for i, m in enumerate(messages) if i not in later]
    if rest and rest[0].get("role") == "system":
        first = {**rest[0], "content": "\n\n".join([str(rest[0].get("content") or ""), *texts])}
        return [first, *rest[1:]]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]
