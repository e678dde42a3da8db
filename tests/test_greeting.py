"""The instruction that asks for a person's name (the `name` aspect): SmolLM2-135M writes a name it
is told, not "the user's name" (flywheel/bus/instructions.py, `GREETING`). The record keeps the
slot, never a name; the gateway fills it with the name its session's first request gives the
person, the judge's teacher with the name of the turn it is told, the bench as the gateway does;
a person who gives none is asked for "the user's name"."""

from __future__ import annotations

import time

from flywheel.bus.instructions import GREETING, Instructions, addressed, names_in, persons_words
from flywheel.config.judge import TeacherConfig
from flywheel.config.memory import MemoryConfig
from flywheel.drills.personal_agent import Asked, with_memory
from flywheel.judge.teacher import told
from flywheel.judge.wishes import ASPECTS
from flywheel.serve.api.chat import ChatCompletionRequest
from flywheel.serve.api.sessions import session_of
from flywheel.serve.ops.tenants import OPEN, Grant
from flywheel.serve.served_memory import ServedMemory

NAME, SHORTER = ASPECTS["name"], ASPECTS["shorter"]
DEAR_ADA = NAME.replace(GREETING, '"Dear Ada,"')
NAMELESS = NAME.replace(GREETING, "\"Dear\" and the user's name")


def request(session: str, *said: dict):
    headers = {"x-session-id": session, "x-user-id": "ada"}
    return (ChatCompletionRequest(model="tiny", messages=list(said)),
            session_of(headers, None, None, grant=Grant("open", OPEN.training, True)))


def test_the_gateway_greets_a_person_by_the_name_their_sessions_first_request_gives():
    memory = ServedMemory("\n\nAsked: $instructions", placement="user")
    memory.take(Instructions(id="r", tenant="open", user_id="ada", instructions=[SHORTER, NAME], read=[], turns=[],
                             read_from=1.0, created_at=time.time()))
    system = {"role": "system", "content": "You are Ada's personal assistant."}
    body, (served, _, _) = memory.applied(*request("s1", system, {"role": "user", "content": "Hi"}))
    assert served == (SHORTER, DEAR_ADA) and GREETING in NAME  # what the turn records: what the model was told
    first = body.messages[1].text()
    assert first == f"{SHORTER} {DEAR_ADA}\n\nHi" and persons_words(first, served) == "Hi"
    later = request("s1", system, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "I'm Bea, by the way."})
    assert memory.applied(*later)[1].instructions == served  # the session keeps what it started with: its prompts extend
    assert memory.applied(*request("s2", {"role": "user", "content": "Call me Bea. Hi"}))[1].instructions == (
        SHORTER, NAME.replace(GREETING, '"Dear Bea,"'))
    assert memory.applied(*request("s3", {"role": "user", "content": "Hi"}))[1].instructions == (SHORTER, NAMELESS)


def test_the_teacher_and_the_bench_greet_the_person_by_the_name_the_conversation_gives():
    turn = [{"role": "system", "content": "You help."}, {"role": "user", "content": "My name is Ada. Where is Lisbon?"}]
    assert told(turn, NAME, TeacherConfig())[-1]["content"].endswith(f"how to do better: {DEAR_ADA}]")
    assert told(turn[:1], f"{SHORTER} {NAME}", TeacherConfig())[-1]["content"].endswith(f"{SHORTER} {NAMELESS}]")
    asked = Asked("You are Ada's personal assistant.", (NAME,), MemoryConfig(placement="user")).chat("Where is Lisbon?")
    assert asked[1]["content"] == f"{DEAR_ADA}\n\nWhere is Lisbon?"
    assert with_memory("S.", "Ada", ["Please call me by my name."], "instead").endswith(f"like replies: {DEAR_ADA}")


def test_a_name_in_a_recorded_messages_text_parts_is_found_and_other_parts_are_not_read():
    """Recorded turns keep content as text parts (flywheel/bus/messages.py, `content_parts`): the
    name is read in them, across parts and roles, in the order first said; an image part is no text."""
    turn = [{"role": "system", "content": [{"type": "text", "text": "You are Ada's personal assistant."}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}},
                                         {"type": "text", "text": "Call me Bea."}, {"type": "text", "text": "Hi"}]}]
    assert names_in(turn) == ["Ada", "Bea"] and names_in([{"role": "user", "content": None}]) == []
    assert told(turn, NAME, TeacherConfig())[-1]["content"][-1]["text"].endswith(f"how to do better: {DEAR_ADA}]")


def test_a_text_without_the_greeting_is_left_as_it_is():
    assert addressed(SHORTER, ["Ada"]) == SHORTER and addressed("", []) == ""
