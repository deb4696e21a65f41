"""Incremental detokenization streams exactly the text of a full decode."""

import pytest

from kvserve.engine.detokenizer import detokenize_step, start_state

TEXTS = [
    "naïve café — 東京 🚀 emoji 👩‍👩‍👧 and spaces   here\n\n  indented",
    " leading space, then Ελληνικά and العربية and 한국어 mixed.",
    "<start_of_turn>user\nHi<end_of_turn>\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(kv, text):
    tok = kv.tokenizer
    prompt = tok("Prefix:").input_ids
    out = tok(text, add_special_tokens=False).input_ids
    ids = list(prompt)
    state = start_state(prompt)
    pieces = []
    for t in out:
        ids.append(t)
        pieces.append(detokenize_step(tok, ids, state))
    assert "".join(pieces) == tok.decode(out, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)  # never a broken character mid-stream
