"""The ShareGPT reader: records up to the file's cut, clean alternating turns."""

from kvserve.datasets.sharegpt import _clean_turns, load_conversations, records


def test_records_stop_at_the_cut():
    text = '[{"a": 1}, {"b": [2, 3]},\n {"c": "x"}, {"d": "unfinish'
    assert list(records(text)) == [{"a": 1}, {"b": [2, 3]}, {"c": "x"}]
    assert list(records('[{"a": 1}]')) == [{"a": 1}]


def test_turns_alternate_from_a_human_turn():
    raw = [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "q1"},
           {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"}]
    assert _clean_turns(raw) == (("human", "q1"), ("gpt", "a1"))


def test_packaged_dataset_loads():
    convs = load_conversations(limit=50)
    assert len(convs) == 50
    assert all(c.turns[0][0] == "human" and len(c.turns) % 2 == 0 for c in convs)
