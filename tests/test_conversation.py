"""Multi-turn conversations (ragcache.conversation): splitting a message list, the retrieval-query rule."""

from __future__ import annotations

import pytest

from ragcache.conversation import Turn, refers_back, retrieval_query, split_messages

Q1 = "What is the capital of Zorbia?"
HISTORY = [Turn("user", Q1), Turn("assistant", "Velmora.")]


def test_the_last_user_message_is_the_question_and_the_rest_is_history_in_order():
    msgs = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": Q1},
            {"role": "assistant", "content": "Velmora."}, {"role": "user", "content": "Who founded it?"}]
    question, history = split_messages(msgs)
    assert question == "Who founded it?"
    assert history == [Turn("system", "Answer in French."), *HISTORY]
    assert split_messages([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "q"}])[1] == [
        Turn("system", "Be brief.")]


@pytest.mark.parametrize("msgs, match", [
    ([], "messages is empty"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
     r"messages\[1\] must be a non-empty user"),
    ([{"role": "user", "content": "   "}], r"messages\[0\] must be a non-empty user"),
    ([{"role": "tool", "content": "x"}, {"role": "user", "content": "q"}], r"messages\[0\]\.role is 'tool'"),
    ([{"role": "user", "content": None}], r"messages\[0\]\.content must be a string"),
])
def test_bad_message_lists_name_the_message_and_the_fix(msgs, match):
    with pytest.raises(ValueError, match=match):
        split_messages(msgs)


@pytest.mark.parametrize("question", ["Who founded it?", "When?", "And the food?", "What about its parliament?",
                                      "How big is that city on the river?"])
def test_a_short_or_referring_follow_up_retrieves_with_the_previous_question(question):
    assert refers_back(question)
    assert retrieval_query(question, HISTORY) == f"{Q1} {question}"


@pytest.mark.parametrize("question", ["Where does the parliament meet?", "What is the national dish of Zorbia?"])
def test_a_full_question_retrieves_alone(question):
    assert not refers_back(question)
    assert retrieval_query(question, HISTORY) == question


def test_only_the_previous_user_message_is_added_never_the_answers_or_older_turns():
    history = [Turn("user", "What is kelmet?"), Turn("assistant", "A stew."), *HISTORY]
    assert retrieval_query("Who founded it?", history) == f"{Q1} Who founded it?"
    assert retrieval_query("Who founded it?", []) == "Who founded it?"  # no earlier user message
    assert retrieval_query("Who founded it?", [Turn("system", "Be brief.")]) == "Who founded it?"
