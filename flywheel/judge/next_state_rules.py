"""The `next_state` judge's classifier of a user's words: what they said after an assistant reply,
as one class and the cue that decided it (`flywheel/judge/next_state_classes.py`). Rules over the
structure of the message; no model. Tool output: `flywheel/judge/next_state_tool_output.py`.

User words (`classify_user_text`), in this order:
1. pasted tool output (a traceback, a test summary) is read as tool output, and test results told
   in words ("all tests pass now") as test results;
2. contrast: with "but" ("however", "ma", "mais", "aber", "pero"), what follows decides, and a
   directive after it is a correction ("thanks, but use the logging module");
3. idioms are read whole: "no worries", "not bad", "nothing wrong", "no more errors" approve;
   quoted words are mentioned, not meant;
4. negative cues: a hint of how to do better ("I meant", "should", "instead", "X, not Y", "you
   forgot", a directive after a rejection) makes a correction; a rejection or a complaint alone
   ("still broken", "doesn't work", sarcasm) a complaint. In a question they count only when it
   is aimed at the reply ("why doesn't it work?"): "why doesn't the sky fall?" moves on;
5. thanks;
6. a restatement of the turn's own request (content-word overlap), or "let me rephrase", is a
   retry even without a negative word; an additive opener ("now", "next", "also", "what about")
   makes a request moving on whatever its overlap;
7. a new question or directive moves on, unless it asks what the reply meant (clarification,
   unclear); then approval; deferrals ("let me check") and anything else are unclear.
Precedence among the positive classes: thanks, then moving on, then acceptance.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flywheel.judge.next_state_classes import Call
from flywheel.judge.next_state_tool_output import runner_verdict

_SPELLING = {"dont": "don't", "doesnt": "doesn't", "didnt": "didn't", "isnt": "isn't", "wasnt": "wasn't",
             "arent": "aren't", "cant": "can't", "wont": "won't", "shouldnt": "shouldn't", "couldnt": "couldn't",
             "wouldnt": "wouldn't", "thats": "that's", "whats": "what's", "im": "i'm", "ive": "i've", "u": "you"}
_TYPO_TARGETS = ("thanks", "works", "worked", "perfect", "correct", "wrong", "broken", "great", "awesome", "exactly")
_PASTED_ERROR = re.compile(r"Traceback \(most recent call last\)|^\s*[\w.]*(?:Error|Exception): ", re.M)
_QUOTED = re.compile(r"(?<!\w)(['\"`])[^'\"`\n]{1,60}\1(?!\w)")
_CONTRAST = re.compile(r"(?:^|[\s,;.!-])(but|however|ma|mais|aber|pero)\b[\s,:-]*", re.I)
_POSITIVE_IDIOM = re.compile(
    r"\b(?:no (?:worries|problem|complaints|issues|(?:more |further )?(?:questions|changes(?: needed)?|errors?))|"
    r"not (?:bad|a problem)|nothing wrong|can't complain|couldn't be better|(?:the )?errors? (?:is|are) gone|"
    r"no longer (?:fails|crashes|errors))\b")
_NEUTRAL_IDIOM = re.compile(r"\b(?:not your fault|no idea|not sure|no rush|no hurry)\b")
_HINT = re.compile(
    r"\bi (?:meant|said|asked(?: for)?|was asking|wanted|only (?:want|need|asked))\b|\bshould\b|\binstead\b|"
    r"\brather than\b|\bnot what i\b|\byou (?:forgot|missed|ignored|left out|skipped|need|have to|must)\b|"
    r"\bthe other (?!day|week|time)\w+|\b(?:please )?(?:don't|do not) (?:use|add|change|touch|remove|do)\b|"
    r"\bnot (?:quite|exactly)\b|\byours (?:has|is|does|uses)\b|\b(?:it|this|that|line|code) needs\b|"
    r"\btoo (?:vague|long|short|slow|verbose|complicated|complex|generic|much|many|few)\b|^(?:close|almost|actually)\b")
_NOT_X_SKIP = frozenset("is are was were am be been do does did have has can could will would should must may might that's "
                        "it's what's there's i'm why if or and but that it this i you we they he she rather hopefully "
                        "probably maybe definitely certainly absolutely just".split())
"""Words before a "not" that make it a plain negation, not "X, not Y"."""
_NOT_X = re.compile(r"([\w'./*]+),?\s+not\s+(?:all of\s+)?[\w./*]+")
_COMPLAINT = re.compile(
    r"\b(?:(?:does|did|is|was|will|do) not|doesn't|didn't|isn't|wasn't|won't|don't|not) "
    r"(?:work|working|help|compile|run|load|start|build)\b|"
    r"\bstill (?:broken|fail\w*|wrong|crash\w*|not|the same|happens|doesn't|there)\b|"
    r"\bsame (?:thing|error|problem|issue|code|result)\b|"
    r"\b(?:broken|broke|useless|garbage|terrible|awful|nonsense|worse|worst|slower|wtf|ugh|meh|smh|wasted?|"
    r"crash(?:ed|es|ing)?|hallucinat\w*|wrong|incorrect)\b|\bmakes? no sense\b|\byou keep\b|"
    r"\bnothing (?:compiles|works|happens|changed|runs|loads)\b|"
    r"\bmade (?:that|it|this) up\b|\bthere(?:'s| is) no\b|^(?:oh|yeah),? (?:sure|great|right|perfect|wonderful|brilliant)\b|"
    r"\b(?:it|this|that|you|your \w+) (?:still )?(?:doesn't|does not|didn't|did not|isn't|is not|won't|can't)\b|"
    r"\bc'est pas\b|\bpas (?:bon|ça|correct|juste)\b|\bfalsch\b|\bfunktioniert nicht\b|\bno funciona\b|\bmarche pas\b")
_CRITICAL_QUESTION = re.compile(
    r"\b(?:doesn't|didn't|isn't|wasn't|won't|can't|shouldn't) (?:it|this|that|you)\b|"
    r"\b(?:it|this|that|you) (?:still )?(?:doesn't|didn't|isn't|wasn't|won't|can't|does not|did not|is not)\b|"
    r"\b(?:it|this|that)(?:'s| is) still\b|\bwhy did you\b|\bwhat happened to\b")
_OFF_QUESTION = re.compile(r"\b(?:has|had|have) (?:nothing|little) to do with (?:what i (?:asked|said|meant|wanted)|my question)\b")
"""The reply missed the question: a complaint, and the "what I asked" in it is no hint of how to do better."""
_REJECTION = re.compile(r"^(?:no|nope|nah|nein|non|wrong|incorrect|stop)\b|\bno\b(?=\s*(?:[!.,;:]|$))")
_DIRECTIVE = frozenset("use add make describe start stop change put remove return try read write fix call set keep include "
                       "drop rename replace move check look give show convert switch revert undo delete swap sort apply "
                       "handle accept raise print pass wrap only".split())
_THANKS = re.compile(r"\b(?:thanks|thank you|thx|thanx|tnx|ty|tysm|cheers|appreciated?|merci|danke|gracias|"
                     r"grazie|obrigad[oa]|kudos)\b|🙏")
_TESTS_FAILING_WORDS = re.compile(
    r"\btests? (?:still )?(?:fail|fails|failed|failing|are failing|are red|don't pass|do not pass)\b")
_TESTS_PASSING_WORDS = re.compile(r"\btests? (?:now )?(?:pass|passes|passed|are passing|are green)\b")
_RETRY = re.compile(
    r"^again\b|\bonce more\b|\bone more time\b|\blet me rephrase\b|\bin other words\b|\bi'll ask again\b|\btry again\b")
_ADDITIVE = re.compile(
    r"^(?:and|also|now|next|then|btw|by the way|what about|how about|moving on|let's move on|switching topics|"
    r"unrelated|new question|another question|one more thing)\b|\balso\b")
_QUESTION_START = frozenset("how what what's why when where which who can could would will is are do does should any"
                            .split())
_CLARIFY = re.compile(r"\bwhat do you mean\b|\bdo you mean\b|\bwhat does \w+ mean\b|\byou're saying\b|\bso you mean\b")
_ACCEPT = re.compile(
    r"\b(?:perfect|great|awesome|excellent|nice|cool|lgtm|brilliant|amazing|fantastic|neat|solid|super|wonderful|bravo|"
    r"exactly|spot on|love it|nailed it|ship it|sounds good|looks (?:good|great|fine|right)|all good|makes sense|that's it|"
    r"did it|did the trick|works?|worked|working now|fixed it|solved|correct|good|helpful|useful|"
    r"(?:that's|it's|is|you're) (?:\w+ )?right|"
    r"funktioniert|klappt|parfait|ça marche|funciona|genial|perfecto|okidiom)\b|👍|🎉|✅")
_NEGATED = re.compile(r"(?:\bnot|n't|\bnever|\bno)\s+(?:\w+\s+)?$")
_DEFER = re.compile(r"\b(?:let me (?:check|try|see|test|look)|one sec|brb|hold on|give me a (?:sec|minute)|"
                    r"i'll (?:try|check|test|look)|(?:later|tomorrow)\b)")
_WEAK_OK = frozenset("ok okay k kk sure fine alright yes yep yeah yup good".split())
_STOP = frozenset("a an the to of in on for with by at from as and or is are was were be been it this that these those i "
                  "me my you your we our do does did how what what's which who when where why can could would should will "
                  "please pls plz just again exactly actually really so some any give show tell need want ok okay hey hi "
                  "there if whether than then into about one more time let rephrase s t i'm it's that's".split())


def _normalise(text: str) -> str:
    text = _QUOTED.sub(" q ", text.lower().replace("\u2019", "'").replace("\u2018", "'"))
    return re.sub(r"[a-z']+", lambda m: _SPELLING.get(m[0]) or _typo(m[0]), text).strip()


def _typo(word: str) -> str:
    """The cue word a typo stands for: one adjacent swap ("thnaks") or one dropped letter ("thnks")."""
    if len(word) < 4 or word in _TYPO_TARGETS:
        return word
    for target in _TYPO_TARGETS:
        if len(target) == len(word):
            diff = [i for i, (a, b) in enumerate(zip(word, target)) if a != b]
            if len(diff) == 2 and diff[1] == diff[0] + 1 and word[diff[0]] + word[diff[1]] == target[diff[1]] + target[diff[0]]:
                return target
        elif len(target) >= 6 and len(word) == len(target) - 1:
            if any(target[:i] + target[i + 1:] == word for i in range(len(target))):
                return target
    return word


def content_words(text: str) -> set[str]:
    """The words that carry a request's content: lower case, no stop words, crude stems."""
    out = set()
    for word in re.findall(r"[a-z0-9']+", _normalise(text)):
        if word in _STOP or len(word) < 2:
            continue
        word = word.removesuffix("'s")
        if word.endswith("ies") and len(word) > 4:
            word = word[:-3] + "y"
        elif word.endswith("ing") and len(word) > 5:
            word = word[:-3]
        elif word.endswith("ed") and len(word) > 4:
            word = word[:-2]
        elif word.endswith("s") and not word.endswith("ss") and len(word) > 3:
            word = word[:-1]
        out.add(word)
    return out


def overlap(a: set[str], b: set[str]) -> tuple[int, float]:
    """Shared content words, and their share of the smaller set."""
    shared = len(a & b)
    return shared, shared / min(len(a), len(b)) if a and b else 0.0


@dataclass(frozen=True)
class _Parsed:
    norm: str
    """The message in lower case, typos of cue words mended, quotes dropped, idioms read."""
    sentences: list[tuple[str, bool]]
    """(sentence, is a question)."""
    clauses: list[tuple[str, bool]]
    """The sentences' comma- and dash-separated pieces, with their sentence's question flag."""


def _parse(text: str) -> _Parsed:
    norm = _NEUTRAL_IDIOM.sub(" ", _POSITIVE_IDIOM.sub(" okidiom ", _normalise(text)))
    sentences, clauses = [], []
    for piece in re.finditer(r"[^.!?;\n]+[.!?;\n]*", norm):
        sentence = piece[0].strip(" .!;\n")
        words = sentence.rstrip("?").split()
        if not words:
            continue
        question = sentence.endswith("?") or words[0] in _QUESTION_START
        sentences.append((sentence.rstrip("?"), question))
        for part in re.split(r",\s*|\s+-+\s+|\s*—\s*|:\s+", sentence.rstrip("?")):
            if part.strip():
                clauses.append((part.strip(), question))
    return _Parsed(norm, sentences, clauses)


def _directive(clause: str) -> bool:
    words = [w for w in clause.split() if w not in ("please", "pls", "just", "then")]
    return bool(words) and words[0] in _DIRECTIVE


def _not_x(sentence: str) -> str | None:
    """'utils.py, not helpers.py', 'seconds, not milliseconds': what it should be, against what it was."""
    for m in _NOT_X.finditer(sentence):
        if m[1] not in _NOT_X_SKIP:
            return m[0]
    return None


def _negative(parsed: _Parsed, after_contrast: bool) -> Call | None:
    hints, complaints = [], []
    for sentence, question in parsed.sentences:
        if question:
            if m := _CRITICAL_QUESTION.search(sentence):
                complaints.append(m[0])
            continue
        if off := _OFF_QUESTION.search(sentence):
            complaints.append(off[0])
            sentence = sentence[:off.start()] + sentence[off.end():]
        hints += [m[0] for m in [_HINT.search(sentence)] if m] + [x for x in [_not_x(sentence)] if x]
        complaints += [m[0] for m in [_COMPLAINT.search(sentence)] if m]
        complaints += [f"not {m[0]}" for m in _ACCEPT.finditer(sentence)
                       if m[0] != "okidiom" and _NEGATED.search(sentence[:m.start()])]
    statements = [c for c, question in parsed.clauses if not question]
    rejection = next((m[0] for c in statements for m in [_REJECTION.search(c)] if m), None)
    directive = next((c for c in statements if _directive(c) and not _ADDITIVE.search(c)), None)
    if hints:
        return Call("correction", f"user: correction cue {hints[0]!r}")
    if after_contrast and directive:
        return Call("correction", f"user: directive after a contrast {directive!r}")
    if not (rejection or complaints):
        return None
    if directive:
        return Call("correction", f"user: {(rejection or complaints[0])!r} and a directive {directive!r}")
    rest = len(parsed.norm.split()) - 1
    if rejection and not complaints and _ACCEPT.search(parsed.norm):
        return None  # "no, that's perfect": the no answers a question, the rest approves
    if rejection and not complaints and rest >= 2:
        return Call("correction", f"user: rejection {rejection!r} and what it should be")
    return Call("complaint", f"user: complaint cue {(complaints or [rejection])[0]!r}")


@dataclass(frozen=True)
class _Context:
    request: str
    reply: str
    retry_overlap: float
    retry_min_shared: int


def _words(parsed: _Parsed, context: _Context, after_contrast: bool) -> Call:
    if negative := _negative(parsed, after_contrast):
        return negative
    norm = parsed.norm
    if m := _THANKS.search(norm):
        return Call("thanks", f"user: thanks {m[0]!r}")
    additive = next((c for c, _ in parsed.clauses if _ADDITIVE.search(c) and not _ACCEPT.search(c)), None)
    if additive:
        return Call("moving_on", f"user: additive request {additive!r}")
    if m := _RETRY.search(norm):
        return Call("retry", f"user: retry cue {m[0]!r}")
    mine = content_words(norm)
    shared, share = overlap(mine, content_words(context.request))
    if shared >= context.retry_min_shared and share >= context.retry_overlap:
        return Call("retry", f"user: restates the request ({shared} shared words, {share:.2f} of the shorter)")
    requests = [c for c, question in parsed.clauses
                if len(c.split()) >= 2 and (question or _directive(c) or c.startswith("let's"))]
    if requests:
        asked = content_words(" ".join(requests))
        if _CLARIFY.search(norm) or (asked and len(asked & content_words(context.reply)) / len(asked) >= 0.6):
            return Call("unclear", "user: asks what the reply meant")
        return Call("moving_on", f"user: new request {requests[0]!r}")
    if m := _ACCEPT.search(norm):
        return Call("acceptance", f"user: approval {'idiom' if m[0] == 'okidiom' else repr(m[0])}")
    if m := _DEFER.search(norm):
        return Call("unclear", f"user: deferral {m[0]!r}")
    words = re.findall(r"[a-z']+", norm)
    if words and all(w in _WEAK_OK for w in words):
        return Call("acceptance", f"user: {' '.join(words)!r}")
    return Call("unclear", "user: no cue")


def classify_user_text(text: str, request: str = "", reply: str = "", retry_overlap: float = 0.6,
                       retry_min_shared: int = 2) -> Call:
    """A user's message after the reply (or feedback text about it): `request` is what the turn
    was asked (for retries), `reply` the reply (for clarification questions)."""
    if not text.strip():
        return Call("unclear", "user: empty message")
    pasted = runner_verdict(text)
    if pasted and pasted.label != "unclear":
        return Call(pasted.label, f"user pasted a {pasted.cue}")
    if _PASTED_ERROR.search(text):
        return Call("error", "user pasted an error")
    norm = _normalise(text)
    if m := _TESTS_FAILING_WORDS.search(norm):
        return Call("tests_failing", f"user: {m[0]!r}")
    if m := _TESTS_PASSING_WORDS.search(norm):
        return Call("tests_passing", f"user: {m[0]!r}")
    context = _Context(request, reply, retry_overlap, retry_min_shared)
    if split := contrast_split(text):
        marker, head, tail = split
        after = _words(_parse(tail), context, after_contrast=True)
        if after.label != "unclear":
            return Call(after.label, f"after {marker!r}: {after.cue}", after_contrast=True)
        return _words(_parse(head), context, after_contrast=False)
    return _words(_parse(text), context, after_contrast=False)


def contrast_split(text: str) -> tuple[str, str, str] | None:
    """(marker, head, tail) at the last contrast ("thanks, but ...") with words on both sides."""
    for m in reversed(list(_CONTRAST.finditer(text))):
        head, tail = text[:m.start()], text[m.end():]
        if re.search(r"\w", head) and re.search(r"\w", tail):
            return m[1].lower(), head, tail
    return None
