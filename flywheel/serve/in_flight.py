"""One chat or completions request in flight: its n choices against an engine, the OpenAI
answer (whole, or as server-sent events), and a recorded turn per choice when it ends.

Every path records its turns: a finished answer, an engine error, a timeout, and a client that
disconnects mid-stream (its choices are aborted in the engine and recorded with
`client_disconnected`). What the client is told ends only once its turns are durable (on the
bus, or fsync'd to the spill file): a whole answer is sent, and a stream's last events with
`[DONE]`, after `Recorder.durable`; if the turns cannot be kept, a whole answer is a 503 and a
stream ends with an error event instead of `[DONE]`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from flywheel.bus import (
    SESSION_EVENT_SUBJECT,
    TURN_SUBJECT,
    SessionEvent,
    Timings,
    Turn,
)
from flywheel.formats.tool_calls import ToolFormat
from flywheel.serve.adapter_routing import AdapterChoice
from flywheel.serve.api.chat import (
    ChatCompletionRequest,
    CompletionRequest,
    sampling_params,
)
from flywheel.serve.api.formatting import chat_message, output_text
from flywheel.serve.api.sessions import SessionInfo
from flywheel.serve.api.wire import Wire
from flywheel.serve.backends.base import EngineClient, EngineError
from flywheel.serve.best_of import BestOf
from flywheel.serve.engine_choice import Choice
from flywheel.serve.personal_data import PersonalData, texts_of
from flywheel.serve.recorder import Recorder, RecordLost
from flywheel.serve.streamed_text import StreamedText
from flywheel.tenants.forgotten import Forgettings


@dataclass
class Generation:
    body: ChatCompletionRequest | CompletionRequest
    engine: EngineClient
    tokenizer: Any
    recorder: Recorder
    model_name: str
    session: SessionInfo
    prompt_ids: list[int]
    prompt_text: str | None
    """The text the prompt ids stand for, as the client wrote it (None: the client gave ids)."""
    max_new_tokens: int
    wire: Wire
    """What the client sees: the API's answer object and stream events."""
    forced: str = ""
    """Prompt text that forces a tool call, or the served memory's opening (no tools); the
    answer's text starts with it."""
    tool_format: ToolFormat | None = None
    """How the model writes tool calls, when the request has tools active (None: no tools)."""
    on_finish: Callable[["Generation"], None] | None = None
    personal_data: PersonalData | None = None
    """The tenant's personal-data policy's detectors and counts (needed unless `session.pii` is off)."""
    timeout_s: float | None = None
    """A stream running longer than this ends with an error event (its choices are aborted)."""
    adapter: str | None = None
    """The LoRA adapter the request belongs to (flywheel/serve/adapter_routing.py; None: the shared
    weights): its turns' `Turn.adapter`, and their versions are that adapter's."""
    lora_path: str | None = None
    """The adapter the engine is asked for: `adapter` once it has a published version; before,
    its origin's or None (the bare base), and its tokens are recorded as its version 0."""
    forgettings: Forgettings | None = None
    """Forgets this gateway heard of: a turn of someone forgotten while it ran is not recorded."""
    best_of: BestOf | None = None
    """Serve the best of several replies by the checks of the person's wish (`memory.best_of`)."""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    arrived: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.chat = self.wire.chat
        self.choices = [Choice(i, f"{self.id}-{i}") for i in range(self.body.n)]
        self.top_n = (self.body.top_logprobs or 0) if self.chat else (self.body.logprobs or 0)
        self.want_logprobs = bool(self.body.logprobs) if self.chat else self.body.logprobs is not None
        self._recorded = False
        self._grammar = None
        if self.forced and self.tool_format is not None:
            tools = [t.model_dump(exclude_none=True) for t in self.body.tools]
            self._grammar = self.tool_format.forced_grammar(self.body.tool_choice, tools)
        self._messages: dict[int, tuple[dict[str, Any], str]] = {}
        self._drawn = 0
        """Which of the `best_of` replies was served (its sampling is recorded)."""
        self.chosen = False
        """Whether the checks chose the reply (else it was served as sampled: `Turn.best_of` 1)."""

    def session_of(self, choice: Choice) -> str:
        """The session the choice's turn is recorded in: with n > 1 each choice continues its own."""
        return f"{self.session.session_id}/{choice.index}" if self.body.n > 1 else self.session.session_id

    def forgotten(self) -> bool:
        """Whether its tenant or user was forgotten while it ran: nothing of it is kept then (its
        turns, its stored response, its tokens for the session's next prompt)."""
        return self.forgettings is not None and self.forgettings.since(self.session.tenant, self.session.user_id,
                                                                       self.arrived)

    def announce(self) -> None:
        """Tell the collector that the session has a request in flight, with its turns' ids: a
        reply slower than `collect.idle_timeout_s` must not close the conversation as idle. Not
        under a personal-data policy: its turns may be dropped once the reply is known, and an
        announced turn that never comes would hold the session for `collect.reply_timeout_s`."""
        if self.session.anonymous or not self.session.store or self.session.pii != "off":
            return
        for choice in self.choices:
            self.recorder.record(SESSION_EVENT_SUBJECT, SessionEvent(
                id=uuid.uuid4().hex, session_id=self.session_of(choice), tenant=self.session.tenant, kind="pending",
                turn_ids=[choice.rid]))

    def message(self, choice: Choice) -> tuple[dict[str, Any], str]:
        """A finished chat choice's assistant message and finish reason, parsed once: the tool
        call ids the client gets are the ones recorded."""
        if choice.index not in self._messages:
            self._messages[choice.index] = chat_message(choice, self.tool_format, self.forced)
        return self._messages[choice.index]

    def _engine_body(self, i: int, draw: int = 0) -> dict[str, Any]:
        """Choice i's engine request; `draw` > 0: another reply of `best_of` for it."""
        return {
            "input_ids": self.prompt_ids,
            "sampling_params": self._sampling(i + draw),
            "return_logprob": True,
            "top_logprobs_num": self.top_n,
            "rid": f"{self.choices[i].rid}+{draw}" if draw else self.choices[i].rid,
            **({"lora_path": self.lora_path} if self.lora_path is not None else {}),
        }

    def _sampling(self, i: int) -> dict[str, Any]:
        """Choice i's SGLang sampling parameters. With `parallel_tool_calls: false` a call's
        closing tag is a stop string too: the answer ends after its first call."""
        params = sampling_params(self.body, self.max_new_tokens, i)
        stop = self.tool_format.single_call_stop if self.tool_format else None
        if stop and not self.body.parallel_tool_calls:
            params["stop"] = [*params.get("stop", []), stop]
        if self._grammar is not None:  # a forced call: it, not the response format, is the answer
            params.pop("json_schema", None)
            params["ebnf"] = self._grammar
        return params

    def continued_text(self, choice: Choice) -> str | None:
        """The text that this prompt plus the choice's output ids stand for, as the client will
        send it back: the prompt's text, then the output's as the client got it (cut before a stop
        string, without special tokens; the model's ids keep them). None when the prompt was
        given as ids."""
        if self.prompt_text is None:
            return None
        return self.prompt_text + output_text(choice, self.tool_format)

    # ---- whole answers ---------------------------------------------------------------------

    async def complete(self) -> dict[str, Any]:
        """The whole answer, once its turns are durable (`RecordLost` if they cannot be)."""
        try:
            if self.best_of is None:
                responses = await asyncio.gather(*(self.engine.generate(self._engine_body(i)) for i in range(self.body.n)))
            else:
                self._drawn, response, self.chosen = await self.best_of.served(
                    self.engine, [self._engine_body(0, j) for j in range(self.best_of.k)])
                responses = [response]
            self.choices = [Choice.from_response(i, c.rid, r) for i, (c, r) in enumerate(zip(self.choices, responses))]
        except BaseException:
            self._record()
            raise
        await self._record_durably()
        return self.wire.answer(self)

    def client_left(self) -> None:
        """The client went away before its answer was ready: its unfinished choices are recorded
        as `client_disconnected` when the cancelled generation records them."""
        for choice in self.choices:
            choice.disconnected = choice.finish is None

    def version(self) -> int:
        """The weight version of the answer: its newest token's (the engine's before any)."""
        versions = [c.version for c in self.choices if c.version is not None]
        return max(versions) if versions else self.engine.weight_version

    def output_tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.choices)

    # ---- streams ---------------------------------------------------------------------------

    def events(self) -> AsyncIterator[bytes]:
        """The answer as server-sent events; recording happens however the stream ends."""
        return self._events()

    def _error_event(self, exc: Exception) -> bytes:
        message = str(exc) if isinstance(exc, (EngineError, RecordLost)) else f"internal error: {type(exc).__name__}"
        return self.wire.failure(self, message, None)

    async def _chunks(self) -> AsyncIterator[tuple[int, dict[str, Any] | None]]:
        """Every choice's engine chunks as (choice index, chunk), and (index, None) when that
        choice's stream has ended; an engine error is raised. One choice is read right here, in
        the response's task (no task and queue in between: the common case is the cheap one);
        several through a pump task each."""
        if self.body.n == 1:
            stream = self.engine.generate_stream(self._engine_body(0))
            try:
                async for chunk in stream:
                    yield 0, chunk
            finally:
                await stream.aclose()  # a choice still generating is aborted in its engine
            yield 0, None
            return
        queue: asyncio.Queue[tuple[int, dict[str, Any] | Exception | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for chunk in self.engine.generate_stream(self._engine_body(i)):
                    await queue.put((i, chunk))
                await queue.put((i, None))
            except Exception as exc:
                await queue.put((i, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(self.body.n)]
        try:
            ended = 0
            while ended < self.body.n:
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                ended += item is None
                yield i, item
        finally:
            for task in tasks:
                task.cancel()  # a choice still generating is aborted in its engine

    async def _events(self) -> AsyncIterator[bytes]:
        """The stream for any number of choices, chat or completions. Role events go out with
        the first event; a choice's final chunk as it finishes, the last one together with the
        usage and `[DONE]` in one write. The request's one timer ends a stream that outlives
        `timeout_s`: it cancels this task while it waits on the engine; while it is elsewhere
        (writing to a slow client) the stream ends at the next chunk."""
        task = asyncio.current_task()
        assert task is not None
        waiting = expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            if waiting:  # then this task is suspended on the engine, inside the try below
                task.cancel()

        timer = asyncio.get_running_loop().call_later(self.timeout_s, expire) if self.timeout_s else None
        chunks = self._chunks()
        streamed = [StreamedText(self.tool_format, self.forced) for _ in self.choices]
        head = self.wire.open(self)
        finished = 0
        try:
            tail = b""  # the stream's last events, sent in one write
            try:
                waiting = True
                async for i, item in chunks:
                    waiting = False
                    if expired:
                        raise asyncio.CancelledError
                    choice = self.choices[i]
                    if item is None:
                        finished += 1
                        tail = self.wire.close(self, choice, streamed[i].shown)
                        if finished < self.body.n:
                            yield head + tail
                            head = tail = b""
                    else:
                        start = len(choice.output_ids)
                        sent = streamed[i].length
                        text = streamed[i].add(choice.add(item))
                        event = self.wire.delta(self, choice, text, start, sent)
                        if event is not None:
                            yield head + event
                            head = b""
                    waiting = True
                waiting = False
            except asyncio.CancelledError:
                waiting = False
                if not expired or (task.cancelling() and task.uncancel() > 0):
                    raise  # the client went away (or someone else cancelled): see below
                tail = self.wire.failure(self, f"the request did not finish within {self.timeout_s} s", "timeout")
            except Exception as exc:  # delivered in-band, after the status line
                tail = self._error_event(exc)
            else:
                tail += self.wire.finish(self)
            yield head + await self._durable_end(tail)
        except (GeneratorExit, asyncio.CancelledError):  # the client went away
            self.client_left()
            raise
        finally:
            waiting = False
            if timer is not None:
                timer.cancel()
            try:
                await chunks.aclose()
            finally:
                self._record()

    async def _durable_end(self, tail: bytes) -> bytes:
        """The stream's last events: `tail` and the wire's end once the turns are durable; else
        an error event (and no successful end)."""
        try:
            await self._record_durably()
        except RecordLost as exc:
            return tail + self._error_event(exc)
        return tail + self.wire.done(self)

    # ---- recording -------------------------------------------------------------------------

    def _record(self) -> None:
        """Record the turns (not waiting for them to be durable)."""
        for turn in self._turns():
            self.recorder.record(TURN_SUBJECT, turn)

    async def _record_durably(self) -> None:
        """Record the turns and wait until they are durable; `RecordLost` if they cannot be."""
        await asyncio.gather(*(self.recorder.durable(TURN_SUBJECT, turn) for turn in self._turns()))

    def _turns(self) -> list[Turn]:
        """The request's turns, once (later calls: none; none at all for a request not to be
        kept, `store: false`, or of someone forgotten while it ran)."""
        if self._recorded or not self.session.store or self.forgotten():
            return []
        self._recorded = True
        several = self.body.n > 1
        turns = []
        for choice in self.choices:
            if self.chat:
                response, finish = self.message(choice)
            else:
                response, finish = {"text": choice.text}, choice.finish_reason
            if choice.disconnected or choice.finish is None:
                finish = "abort"
            turns.append(Turn(
                id=choice.rid,
                session_id=self.session_of(choice),
                tenant=self.session.tenant,
                user_id=self.session.user_id,
                consent=self.session.train,
                turn_index=sum(1 for m in self.body.messages if m.role == "assistant") if self.chat else 0,
                turn_type=self.session.turn_type,
                task_id=self.session.task_id or (self.id if several else None),
                group_size=self.session.group_size if self.session.task_id else (self.body.n if several else None),
                model=self.model_name,
                endpoint=self.wire.endpoint,
                messages=[m.model_dump(exclude_none=True) for m in self.body.messages] if self.chat else [],
                memory=self.session.memory,
                instructions=list(self.session.instructions),
                opening=self.forced if self.tool_format is None else "",
                prompt=self.body.prompt if not self.chat and isinstance(self.body.prompt, str) else None,
                response=response,
                prompt_ids=self.prompt_ids,
                output_ids=choice.output_ids,
                output_logprobs=choice.logprobs,
                adapter=self.adapter,
                output_versions=self._versions(choice),
                finish_reason=finish,
                sampling=self._sampling(choice.index + self._drawn),
                best_of=self.best_of.k if self.best_of and self.chosen else 1,
                session_done=self.session.done,
                client_disconnected=choice.disconnected,
                timings=Timings(
                    first_token_s=(choice.first_token_at - self.arrived) if choice.first_token_at else 0.0,
                    total_s=time.monotonic() - self.arrived,
                ),
            ))
        if self.on_finish is not None:
            self.on_finish(self)
        if self.session.pii != "off" and self._holds_personal_data(turns):
            self.personal_data.dropped[self.session.tenant] += len(turns)
            return []
        return turns

    def _versions(self, choice: Choice) -> list[int]:
        """The versions the choice's tokens are recorded with: the engine's for the adapter or its
        canary; an adapter with no published version yet was served by what it starts from (its
        origin, or the bare base), and its tokens are the adapter's version 0."""
        return AdapterChoice(self.adapter, self.lora_path).recorded_versions(choice.versions)

    def _holds_personal_data(self, turns: list[Turn]) -> bool:
        """Under `drop`, whether the request's texts or a reply hold personal data; under
        `redact_input` (the prompt is redacted already), whether a reply does."""
        replies = [text for turn in turns for text in texts_of([turn.response])]
        asked = [] if self.session.pii == "redact_input" else (
            texts_of(turns[0].messages) if self.chat else [self.body.prompt] if isinstance(self.body.prompt, str) else [])
        return self.personal_data.holds([*asked, *replies], self.session.pii_entities)

