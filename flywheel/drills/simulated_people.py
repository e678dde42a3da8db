"""Simulated people for the personal-agent drill (`flywheel/drills/personal_agent.py`,
`bench/personal_agent.py`): a hidden preference each, checked by a deterministic rule, everyday
questions, and what a person says after a reply.

A `User` has a name (its assistant's system message names them, as a personal agent's would),
one `Preference` and a seeded random generator. After each first reply the user complains when
it is no answer at all (`answers`: nothing in common with the question, or one word over and
over; a rule such as "at most 30 words" is easy to meet with nonsense, and a person is not fooled
by it), corrects it when it misses the preference, in words drawn from the preference's
phrasings (some specific: they say what they want; some vague: they only show they are
unhappy), or, when it satisfies both, thanks the assistant or asks something new. Nothing else
reaches the platform: no rewards, no headers beyond the session id.

People written elsewhere (`people_from`: a JSON list, e.g. bench/data/people_heldout.json, written
by a helper from a brief and never read by whoever tunes the judge) keep the preference's rule
and speak in their own `Voice`: their corrections, complaints, thanks and ways of moving on.

Questions: `TRAIN_QUESTIONS` are asked during a trial; `HELD_OUT_QUESTIONS` are never asked
there and measure, after training, whether the preference carries over to new questions.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TRAIN_QUESTIONS = (
    "How do I keep basil alive on a windowsill?",
    "What's a good way to fall asleep faster?",
    "How long should I boil an egg for a soft yolk?",
    "How can I stop my glasses from fogging up?",
    "What should I pack for a weekend hike?",
    "How do I get a coffee stain out of a white shirt?",
    "Is it better to rent or buy a bike in a new city?",
    "How often should I water a cactus?",
    "What can I cook with rice, eggs and spinach?",
    "How do I make my phone battery last longer?",
    "What's a polite way to decline a wedding invitation?",
    "How can I remember people's names better?",
    "What's the best way to learn to touch type?",
    "How do I clean a cast iron pan?",
    "Should I stretch before or after running?",
    "How do I keep cut apples from turning brown?",
    "What is a good gift for a coworker who is leaving?",
    "How can I save money on groceries?",
    "How do I start journaling?",
    "What's a quick breakfast I can take to work?",
    "How do I stop procrastinating on chores?",
    "How should I store fresh herbs?",
    "What do I need to start a small balcony garden?",
    "How do I make my bread rise more?",
    "How can I be more productive in the morning?",
    "What's a fun thing to do on a rainy Sunday?",
    "How do I pick a ripe avocado?",
    "How long can cooked rice stay in the fridge?",
    "How can I get better at small talk?",
    "What's an easy way to start running?",
    "How do I remove a splinter?",
    "What should I look for when buying a used car?",
    "How do I keep my houseplants alive while on vacation?",
    "How do I make cold brew coffee at home?",
    "What's a good way to organize my closet?",
    "How can I drink more water during the day?",
    "How do I write a thank-you note to a teacher?",
    "How do I prepare for a job interview?",
    "How do I stop my cat from scratching the sofa?",
    "What's a simple way to budget each month?",
)
HELD_OUT_QUESTIONS = (
    "How do I descale a kettle?",
    "What's a good way to learn a new language on my own?",
    "How can I make my apartment smell nice?",
    "How do I fix a squeaky door?",
    "What should I bring to a potluck dinner?",
    "How do I keep bananas fresh longer?",
    "How can I sleep better on a plane?",
    "How do I choose a good watermelon?",
    "What's an easy dessert for guests?",
    "How do I stay focused while working from home?",
    "How do I wash a wool sweater?",
    "What's a good stretch for a stiff neck?",
)
NEW_QUESTION_OPENERS = ("Thanks! Next question: ", "Great, thank you. Also, ", "Perfect. Now, ", "Got it, thanks. ", "")
OFF_TOPIC = ("That doesn't answer my question.", "What? That makes no sense.",
             "Huh, that has nothing to do with what I asked.", "You didn't answer my question.")
"""What a person says to a reply that is no answer at all, whatever its form."""
THANKS = ("Thanks, that's exactly how I like it.", "Perfect, thank you!", "Great answer, thanks.",
          "Thank you, that helps.", "Nice, thanks a lot.")

_WORDS = re.compile(r"[A-Za-z0-9']+")
_LIST_LINE = re.compile(r"^\s*(?:[-*•]|\d{1,2}[.)])\s+\S", re.M)
_MARKDOWN = re.compile(r"\*\*|__|`|^\s*#{1,6}\s|^\s*(?:[-*•]|\d{1,2}[.)])\s+\S|^\s*>\s", re.M)
_CONTRACTION = re.compile(
    r"\b\w+n't\b|\b\w+'(?:re|ll|ve|m|d)\b|\b(?:it|that|there|what|here|let|he|she|who|where|how)'s\b", re.I)
_CASUAL = re.compile(r"\b(?:hey|hi|hiya|awesome|cool|gonna|wanna|gotta|stuff|guys|yeah|yep|okay|ok|lol|super|"
                     r"totally|kinda|pretty much|tons)\b", re.I)
_EMOJI = re.compile("[\U0001F300-\U0001FAFF\u2600-\u27BF]")
_NICKNAME = re.compile(r"\bcaptain\b", re.I)
_STEP_ONE = re.compile(r"\bstep 1\b", re.I)
_SENTENCE = re.compile(r"[^.!?\n]+[.!?]*")
_FILLER_OPENERS = re.compile(
    r"^\W*(?:sure|certainly|of course|absolutely|great question|good question|what a|that's a|that is a|"
    r"well|so|okay|ok|hi|hello|hey|i|i'm|i'd|as an|there are|there is|here are|here is|here's|when it comes|"
    r"it depends|in order to|to answer)\b", re.I)


_STOP = frozenset("about after before best better could does doing from good have into just keep long make more most "
                  "much need often should some than that their them then there they this want what when where which "
                  "while will with without would your".split())


def words(text: str) -> list[str]:
    return _WORDS.findall(text)


def first_sentence(text: str) -> str:
    match = _SENTENCE.search(text.strip())
    return match[0].strip() if match else ""


def content_words(text: str) -> set[str]:
    """Lower-cased words of 4+ letters that carry meaning, a plural's "s" dropped."""
    return {w.lower().removesuffix("s") for w in words(text) if len(w) >= 4 and w.lower() not in _STOP}


def answers(question: str, reply: str) -> bool:
    """Whether a reply is an answer at all, as a person sees it at a glance: it speaks of something
    the question named (a content word in common) and is not one word over and over. A rule
    satisfied by nonsense ("You are Pre-cut Your Hair.") does not satisfy the person."""
    said = [w.lower() for w in words(reply)]
    repetitive = len(said) >= 8 and max(said.count(w) for w in set(said)) > 0.3 * len(said)
    return bool(content_words(question) & content_words(reply)) and not repetitive


# ---- the rules: each takes the reply and the user's name, says whether it satisfies ------------

def brief(text: str, name: str, limit: int = 30) -> bool:
    """At most `limit` words (a reply cut at max_tokens is longer than that)."""
    return 0 < len(words(text)) <= limit


def detailed(text: str, name: str, least: int = 40) -> bool:
    """At least `least` words: a full explanation (the opposite wish of `brief`)."""
    return len(words(text)) >= least


def bullets(text: str, name: str) -> bool:
    """At least two list lines ("- ", "* ", "1. ", "2) ")."""
    return len(_LIST_LINE.findall(text)) >= 2


def by_name(text: str, name: str) -> bool:
    """The user's name appears in the reply."""
    return re.search(rf"\b{re.escape(name)}\b", text) is not None


def without_name(text: str, name: str) -> bool:
    """A reply that does not use the user's name (the opposite wish of `by_name`)."""
    return bool(text.strip()) and not by_name(text, name)


def answer_first(text: str, name: str) -> bool:
    """The first sentence is the answer: at most 15 words, no preamble ("Sure!", "Great
    question", "I", "There are many ways", "When it comes to ...")."""
    first = first_sentence(text)
    return 0 < len(words(first)) <= 15 and not _FILLER_OPENERS.search(first)


def plain_text(text: str, name: str) -> bool:
    """No markdown: no bold, code, headings, list lines or quotes."""
    return bool(text.strip()) and not _MARKDOWN.search(text)


def nickname(text: str, name: str) -> bool:
    """The reply calls the person by the nickname they go by, "Captain" (whatever their name)."""
    return _NICKNAME.search(text) is not None


def steps(text: str, name: str) -> bool:
    """Laid out as steps from the start: the first line that has words names "Step 1"."""
    first = next((line for line in text.splitlines() if words(line)), "")
    return _STEP_ONE.search(first) is not None


def formal(text: str, name: str) -> bool:
    """A formal register: no contractions, exclamation marks, casual words or emoji."""
    return bool(text.strip()) and not (_CONTRACTION.search(text) or "!" in text or _CASUAL.search(text)
                                       or _EMOJI.search(text))


@dataclass(frozen=True)
class Preference:
    kind: str
    rule: Callable[[str, str], bool]
    specific: tuple[str, ...]
    """Corrections that say what the user wants ({name} is the user's name)."""
    vague: tuple[str, ...]
    """Corrections that only say the reply was not it."""


PREFERENCES: dict[str, Preference] = {p.kind: p for p in (
    Preference("brief", brief,
               specific=("Too long. Keep it under 30 words, please.", "That's too long, I only need two short sentences.",
                         "No, shorter please: one or two sentences.", "You should keep answers under 30 words."),
               vague=("That's way too much text.", "Ugh, too long to read.", "Hmm, not quite. Too verbose.")),
    Preference("detailed", detailed,
               specific=("Too short. Please explain it in detail, a full paragraph.",
                         "You should give me a longer, more thorough answer.",
                         "No, I need more detail: walk me through it properly.", "That's too brief, explain more."),
               vague=("That's not enough for me.", "Hmm, I expected more than that.", "Not quite. Too thin.")),
    Preference("bullets", bullets,
               specific=("Please use bullet points instead of a paragraph.", "You should answer as a bulleted list.",
                         "No, give it to me as a list of short bullet points.", "I asked for bullet points, not prose."),
               vague=("Hmm, not quite how I like it. Too much of a wall of text.", "Not quite. Hard to skim.",
                      "That's not what I wanted, the format is wrong.")),
    Preference("name", by_name,
               specific=("You should call me by my name, {name}.", "Please address me as {name} instead.",
                         "No, use my name, {name}, when you answer.", "You forgot my name. I'm {name}."),
               vague=("Not quite. That felt impersonal.", "Hmm, that's not what I wanted, it's too generic.",
                      "You forgot something. A personal touch.")),
    Preference("no_name", without_name,
               specific=("Please don't use my name.", "You don't need to call me {name}, just answer.",
                         "No names, please. Just the answer.", "Stop addressing me by my name."),
               vague=("Hmm, that felt a bit too familiar.", "Not quite. Too chummy.",
                      "That's not how I like to be spoken to.")),
    Preference("answer_first", answer_first,
               specific=("No, give me the answer first, then explain.", "You should start with the answer itself, no intro.",
                         "No, put the short answer in the first sentence.", "Too much preamble. Lead with the answer."),
               vague=("Not quite, it takes too long to get to the point.", "Hmm, that's not what I wanted.",
                      "Ugh, get to the point.")),
    Preference("plain", plain_text,
               specific=("Please use plain text instead of markdown.", "No, no markdown: no asterisks, no lists, no headings.",
                         "You should write plain sentences without any formatting.",
                         "Don't use lists or bold, just plain prose."),
               vague=("That's not what I wanted, the formatting looks messy.", "Hmm, not quite. Too many symbols.",
                      "Ugh, my screen shows all those stars.")),
    Preference("formal", formal,
               specific=("Please use a formal tone instead, no contractions or exclamation marks.",
                         "You should write more formally.", "Too casual. You should write in a formal register.",
                         "No, keep it formal and professional."),
               vague=("Hmm, not quite the tone I wanted.", "Not quite. Too chatty.", "Ugh, way too casual.")),
    Preference("nickname", nickname,
               specific=("Please call me Captain.", "You should address me as Captain.",
                         "No, call me Captain when you answer.", "You forgot: I go by Captain."),
               vague=("Not quite. You forgot what to call me.", "Hmm, that's not how I like to be addressed.",
                      "That felt a bit off, you know what I go by.")),
    Preference("steps", steps,
               specific=("Please walk me through it step by step, starting with 'Step 1:'.",
                         "You should answer in numbered steps: Step 1, Step 2, and so on.",
                         "No, start with Step 1 and go step by step.", "I like answers as steps. Begin with 'Step 1:'."),
               vague=("Hmm, hard to follow.", "Not quite, I can't follow that.", "That's not how I like it laid out.")),
)}

@dataclass(frozen=True)
class Voice:
    """How one person speaks: what they say to a reply that answers but misses their preference,
    to one that answers nothing, to one they like, and how they move on (`{question}` is the new
    question)."""

    corrections: tuple[str, ...]
    off_topic: tuple[str, ...]
    thanks: tuple[str, ...]
    new_question: tuple[str, ...]
    temperament: str = ""


def people_from(path: str | Path) -> dict[str, tuple[str, Preference, Voice]]:
    """{id: (name, preference, voice)} of a people file: a JSON list of objects with `id`, `name`,
    `preference` (a `PREFERENCES` kind), `temperament`, and the `Voice`'s lists."""
    people = {}
    for spec in json.loads(Path(path).read_text()):
        voice = Voice(*(tuple(spec[key]) for key in ("corrections", "off_topic", "thanks", "new_question")),
                      temperament=spec.get("temperament", ""))
        people[spec["id"]] = (spec["name"], PREFERENCES[spec["preference"]], voice)
    return people


PREFERENCE_ORDER = ("answer_first", "brief", "bullets", "formal", "name", "plain", "detailed", "no_name", "nickname",
                    "steps")
"""The preferences in a fixed order, for drawing seeds by position (new ones go at the end, so a
trial of an older one keeps its draws)."""

@dataclass
class User:
    """One simulated person: a name, a hidden preference, their own random draws."""

    name: str
    preference: Preference
    seed: int
    vague_share: float = 0.3
    """How often a correction is vague rather than specific."""
    wants_answers: bool = True
    """Whether a reply must answer the question (`answers`) before its form counts; off only where
    the model cannot answer anything (the untrained `tiny` of the tests)."""
    voice: Voice | None = None
    """Their own words; None: the preference's phrasings and the module's."""
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._order = list(TRAIN_QUESTIONS)
        self.rng.shuffle(self._order)

    @property
    def system(self) -> str:
        return f"You are {self.name}'s personal assistant."

    def question(self, session: int) -> str:
        """The question of session `session` (the pool in this user's order, repeated when exhausted)."""
        return self._order[session % len(self._order)]

    def satisfied(self, reply: str, question: str) -> bool:
        """The reply answers the question and meets the preference."""
        return (answers(question, reply) or not self.wants_answers) and self.preference.rule(reply, self.name)

    def react(self, reply: str, session: int, question: str | None = None, ask: bool = True) -> tuple[str, str | None]:
        """What the person says to a reply in session `session` that answers `question` (default: the
        session's own), and what the reply to that must answer. A complaint when the reply is no
        answer at all, a correction when it misses the preference (the next reply answers the same
        question); else thanks (nothing more to answer) or, when `ask` and half the time, a new
        question: one this user asks in a session only much later, so its first reply there is a
        fresh one."""
        question, voice = question or self.question(session), self.voice
        if self.wants_answers and not answers(question, reply):
            return self.rng.choice(voice.off_topic if voice else OFF_TOPIC), question
        if not self.satisfied(reply, question):
            if voice:
                return self.rng.choice(voice.corrections), question
            vague = self.rng.random() < self.vague_share
            return self.rng.choice(self.preference.vague if vague else self.preference.specific).format(name=self.name), question
        if not ask or self.rng.random() < 0.5:
            return self.rng.choice(voice.thanks if voice else THANKS), None
        new = self.question(session + len(self._order) // 2)
        if voice:
            return self.rng.choice(voice.new_question).format(question=new), new
        opener = self.rng.choice(NEW_QUESTION_OPENERS)
        return opener + (new[0].lower() + new[1:] if opener.endswith(", ") else new), new


NAMES = ("Maya", "Tomas", "Priya", "Jonah", "Lena", "Omar", "Greta", "Kenji")
