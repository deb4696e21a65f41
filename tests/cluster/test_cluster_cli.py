"""`kvserve cluster serve`'s options: which instances and design they ask for."""

import argparse

import pytest

from kvserve.cluster.cli import add_arguments, layout


def parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["serve", *argv])


def test_defaults_are_two_colocated_instances():
    assert layout(parse()) == ("colocated", [("c0", "colocated"), ("c1", "colocated")])


def test_prefill_and_decode_default_to_full_caching():
    design, names = layout(parse("--prefill", "1", "--decode", "2"))
    assert design == "pd-caching-3"
    assert names == [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")]


@pytest.mark.parametrize("argv, message", [
    (("--prefill", "1"), "go together"),
    (("--instances", "2", "--design", "pd-basic"), "needs --prefill"),
    (("--prefill", "1", "--decode", "1", "--design", "colocated"), "takes --instances"),
    (("--instances", "0",), ">= 1"),
])
def test_contradictions_are_refused(argv, message):
    with pytest.raises(SystemExit, match=message):
        layout(parse(*argv))
