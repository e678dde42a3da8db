"""The checks of a reply against what a person's corrections ask (`judge.teacher.practice_reward:
checks`): they rank replies to one request by how much of the aspect each does."""

import pytest

from flywheel.judge.wish_checks import names_in, score

ASKED = [{"role": "system", "content": "You are Maya's personal assistant."},
         {"role": "user", "content": "How do I keep a sourdough starter alive?"}]


@pytest.mark.parametrize("aspect, more, less", [
    ("shorter", "Feed it flour and water daily.",
     "Feed it equal weights of flour and water every day, keep it somewhere warm, and discard half before feeding."),
    ("longer", "Feed it flour and water every day, and keep it warm.", "Feed it daily."),
    ("list", "- Feed it daily.\n- Keep it warm.\n- Discard half first.", "Feed it daily and keep it warm."),
    ("prose", "Feed it daily and keep it warm.", "## Care\n- **Feed** it daily.\n- Keep it warm."),
    ("formal", "Feed it daily and keep it warm.", "Don't forget to feed it! It's hungry!"),
    ("name", "Maya, feed it daily.", "Feed it daily, Maya."),
    ("name", "Feed it daily, Maya.", "Feed it daily."),
])
def test_a_reply_that_does_more_of_what_was_asked_scores_higher(aspect, more, less):
    assert score([aspect], more, ASKED) > score([aspect], less, ASKED)


def test_aspects_without_a_check_score_nothing_and_several_add_up():
    assert score(["simpler"], "Feed it.", ASKED) is None and score(["other", "example"], "Feed it.", ASKED) is None
    reply = "Maya, feed it daily!"
    assert score(["name", "formal", "simpler"], reply, ASKED) == score(["name"], reply, ASKED) + score(["formal"], reply, ASKED)


def test_the_names_a_conversation_gives_are_its_capitalised_words_inside_a_sentence():
    said = [{"role": "system", "content": "You are Maya's personal assistant."},
            {"role": "user", "content": "Hi! I'm Tom. Where is Lisbon?\nThanks"},
            {"role": "assistant", "content": "Dear Sir, Lisbon is in Portugal."}]
    assert names_in(said) == {"Maya", "Tom", "Lisbon"}  # not a line's or sentence's first word, not "I'm", not the assistant's
