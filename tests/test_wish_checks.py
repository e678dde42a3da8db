"""The checks of practice replies against what a person's corrections ask
(`judge.teacher.practice_reward: checks`): they rank a group's replies by how much of the aspect
each does, and say nothing where they cannot."""

import pytest

from flywheel.bus.instructions import names_in
from flywheel.formats.wish_checks import best, rewards

ASKED = [{"role": "system", "content": "You are Maya's personal assistant."},
         {"role": "user", "content": "How do I keep a sourdough starter alive?"}]
LONG = "Feed it equal weights of flour and water every day, keep it somewhere warm, and discard half before feeding."


@pytest.mark.parametrize("aspect, more, less", [
    ("shorter", "Feed it flour and water daily.", LONG),
    ("shorter", "每天喂它面粉和水。", "每天喂它等量的面粉和水，放在温暖的地方，喂之前先倒掉一半。"),  # no spaces: measured alike
    ("longer", "Feed it flour and water every day, and keep it warm.", "Feed it daily."),
    ("list", "- Feed it daily.\n- Keep it warm.\n- Discard half first.", "Feed it daily and keep it warm."),
    ("prose", "Feed it daily and keep it warm.", "## Care\n- **Feed** it daily.\n- Keep it warm."),
    ("formal", "Feed Maya's starter daily; it is hungry.", "Don't forget to feed it! It's hungry!"),  # a possessive is formal
    ("name", "Maya, feed it daily.", "Feed it daily, Maya."),
    ("name", "Feed it daily, Maya.", "Feed it daily."),
    ("name", "Dear Maya, feed it daily.", "Feed it daily, Maya."),  # addressed first, after a greeting
    ("name", "Hi Maya! Feed it daily.", "Hi there! Feed it daily, Maya."),
])
def test_the_reply_that_does_more_of_what_was_asked_gets_the_higher_reward(aspect, more, less):
    high, low = rewards([aspect], [more, less], ASKED)
    assert high > 0 > low and high + low == pytest.approx(0.0)


def test_rewards_are_standardised_per_aspect_and_a_reply_without_words_ranks_last():
    replies = ["Maya, you can't skip a feeding!", "Feed it daily, Maya.", "Maya, feed it daily.", "..."]
    both = rewards(["name", "formal"], replies, ASKED)
    name, formal = rewards(["name"], replies, ASKED), rewards(["formal"], replies, ASKED)
    assert both[3] == min(both) and name[3] == min(name) and sum(both) == pytest.approx(0.0)
    assert max(name[:3]) - min(name[:3]) > 0 and max(formal[:3]) - min(formal[:3]) > 0
    assert both.index(max(both)) == 2  # named first and formal: the most of both


@pytest.mark.parametrize("aspects", [
    [],
    ["simpler"],  # no rule for it
    ["shorter", "example"],  # half checkable: a reward would be for dropping the example
    ["shorter", "longer"],  # opposites
    ["list", "prose"],
])
def test_no_rewards_where_the_rules_cannot_say_what_was_asked(aspects):
    assert rewards(aspects, ["Feed it.", LONG], ASKED) is None


def test_no_rewards_where_the_replies_do_not_differ_in_what_was_asked():
    assert rewards(["name"], ["Feed it daily.", "Keep it warm and fed."], ASKED) is None


def test_a_reply_that_does_not_answer_ranks_last_whatever_its_form():
    replies = ["Sure, happy to help!", "Feed it flour and water daily.", LONG]
    short, answer, long = rewards(["shorter"], replies, ASKED, answered=[False, True, True])
    assert answer > long > short  # the shortest reply says nothing: below the long answer
    alone = rewards(["simpler"], replies, ASKED, answered=[False, True, True])  # no rule for the wish: the answers alone
    assert alone[0] < alone[1] == alone[2]
    wordless = rewards(["simpler"], ["Feed it daily.", "..."], ASKED)  # a reply without a word answers nothing
    assert wordless[1] < wordless[0]


def test_no_rewards_where_no_reply_answers_or_all_answer_a_wish_no_rule_checks():
    assert rewards(["shorter"], ["Sure!", "Happy to help with that."], ASKED, answered=[False, False]) is None
    assert rewards(["simpler"], ["Feed it.", LONG], ASKED, answered=[True, True]) is None


def test_the_names_a_person_goes_by_are_those_the_conversation_gives_them():
    said = [{"role": "system", "content": "You are Maya's personal assistant."},
            {"role": "user", "content": [{"type": "text", "text": "Hi! Call me Tom. Where is Lisbon?"}]},
            {"role": "assistant", "content": "My name is Sage, I am Sage."}]
    assert names_in(said) == ["Maya", "Tom"]  # in the order said; not a place, nor the assistant's own words


def test_the_reply_served_of_k_is_the_checks_first_among_answers_ties_to_the_one_that_says_most():
    """`best` (memory.best_of): the judge's reading of each reply (nats of information about the
    request) decides what answers, what `shorter` ranks (the most said per character) and ties."""
    named = ["Maya, feed it daily.", "Maya, feed it flour and water daily.", "Feed it daily."]
    assert best(["name"], named, ASKED, gains=[10.0, 20.0, 12.0]) == 1  # both named: the one that says more
    assert best(["name"], named, ASKED, gains=[10.0, 0.0, 12.0]) == 0  # the other does not answer
    assert best(["name"], named, ASKED, gains=[4.0, 5.0, 12.0]) == 2  # under half what the third says: no answer
    about = ["One should not use contractions when writing formally.", "Soak it in vinegar, then rinse; that's all!"]
    assert best(["formal"], about, ASKED, gains=[4.0, 30.0]) == 1  # formal, but about the instruction
    short = ["Ah, sourdough!", "Feed it flour and water daily.", LONG]
    assert best(["shorter"], short, ASKED, gains=[2.0, 12.0, 20.0]) == 1  # 0.15, 0.48, 0.22 nats a character
    practice = rewards(["shorter"], short, ASKED, answered=[True, True, True])
    assert practice.index(max(practice)) == 0  # practice's checks, without the reading: the shortest
    assert best(["shorter"], short, ASKED, gains=[0.0, -1.0, 0.0]) is None  # none answers: as sampled
    assert best(["simpler"], short, ASKED, gains=[2.0, 12.0, 20.0]) == 1  # no rule: the first that answers
    assert best(["simpler"], short, ASKED, gains=[12.0, 2.0, 20.0]) == 0  # not the one that says the most
    assert best(["shorter"], ["...", "Feed it."], ASKED, gains=[5.0, 1.0]) == 1  # no word answers nothing
