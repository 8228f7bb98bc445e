"""Incremental detokenization and stop strings: the same text and the same stopping token as
decoding the whole output again after every token, on SmolLM2's tokenizer."""

import random

import pytest

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.engine.detokenizer import INCOMPLETE, Detokenizer
from spin_cluster.tokenizer import Tokenizer

TEXT = (
    "The café on Rue de l'Église serves crème brûlée. 東京の天気は晴れです。 Emoji: 😀🎉👍🏽 "
    "Math: ∑ x² ≤ ½ · π. Code: def f(x):\n    return x ** 2  # THE END is not here\n\nDone."
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return Tokenizer(smollm2_path)


def whole_decode_reference(tokenizer, ids, stop):
    """The engine's former rule: decode the whole output after every token, cut at the first
    stop string; returns (text, index of the token that stopped it or None)."""
    text = ""
    for n in range(1, len(ids) + 1):
        full = tokenizer.decode(ids[:n])
        hits = [i for i in (full.find(s) for s in stop) if i >= 0]
        if hits:
            return full[: min(hits)], n - 1
        finishing = n == len(ids)
        text = full if finishing or not full.endswith(INCOMPLETE) else text
    return text, None


def incremental(tokenizer, ids, stop):
    detok = Detokenizer(tokenizer, stop)
    for n in range(1, len(ids) + 1):
        if detok.add(ids[:n], finishing=n == len(ids)):
            return detok.text, n - 1
    return detok.text, None


def test_the_text_equals_decoding_the_whole_output(tokenizer):
    ids = tokenizer.encode(TEXT)
    detok = Detokenizer(tokenizer)
    for n in range(1, len(ids) + 1):
        detok.add(ids[:n], finishing=n == len(ids))
        assert tokenizer.decode(ids[:n]).startswith(detok.text) and not detok.text.endswith(INCOMPLETE)
    assert detok.text == tokenizer.decode(ids)


def test_a_character_split_over_tokens_appears_once_whole(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1 and tokenizer.decode(ids[:1]).endswith(INCOMPLETE)  # bytes of one character
    detok = Detokenizer(tokenizer)
    seen = []
    for n in range(1, len(ids) + 1):
        detok.add(ids[:n], finishing=False)
        seen.append(detok.text)
    assert seen[:-1] == [""] * (len(ids) - 1) and seen[-1] == "😀"


def test_a_stop_string_across_a_token_boundary_stops_at_the_token_that_completes_it(tokenizer):
    ids = tokenizer.encode(TEXT)
    stop = ("e brûlée. 東",)  # several tokens, starting mid-token
    text, at = incremental(tokenizer, ids, stop)
    assert (text, at) == whole_decode_reference(tokenizer, ids, stop)
    assert text == TEXT[: TEXT.index(stop[0])] and stop[0] in tokenizer.decode(ids[: at + 1])
    assert stop[0] not in tokenizer.decode(ids[:at])


def test_of_several_stop_strings_the_first_to_appear_cuts_at_the_earliest_start(tokenizer):
    ids = tokenizer.encode(TEXT)
    # The text ends at the first token that completes any stop string, cut at the earliest
    # start among the stop strings present then; the order of the stops does not matter.
    for stop in [("Emoji", "天気"), ("天気", "Emoji"), ("Rue de", "café on Rue"), ("x² ≤", "∑ x", "Math")]:
        assert incremental(tokenizer, ids, stop) == whole_decode_reference(tokenizer, ids, stop), stop
    text, _ = incremental(tokenizer, ids, ("café on Rue", "Rue de"))
    assert text == "The "


def test_random_outputs_and_stop_strings_match_whole_decoding(tokenizer):
    rng = random.Random(0)
    ids = tokenizer.encode(TEXT * 2)
    for _ in range(40):
        start = rng.randrange(len(ids) - 20)
        window = ids[start : start + rng.randrange(5, 60)]
        full = tokenizer.decode(window)
        stops = []
        for _ in range(rng.randrange(1, 4)):
            a = rng.randrange(len(full))
            stops.append(full[a : a + rng.randrange(1, 8)].replace(INCOMPLETE, "") or "zz")
        stops.append("never there")
        assert incremental(tokenizer, window, tuple(stops)) == whole_decode_reference(tokenizer, window, tuple(stops))


def test_streamed_text_never_takes_back_what_a_straddling_stop_string_cuts(tiny_llama_path):
    """While running, the last len(longest stop) - 1 characters are held back: the streamed
    pieces add up to the final text even when a stop string begins in an earlier token."""
    engine = Engine(SpinConfig.from_dict({"model": {"path": tiny_llama_path, "device": "cpu"}}), progress=False)
    ids = engine.tokenizer.encode(TEXT)
    stop = ("e brûlée. 東",)
    rid = engine.add_request("Hi", SamplingParams(max_tokens=len(ids), stop=stop, ignore_eos=True))
    req = engine._requests[rid]
    outs = []
    for token_id in ids:
        outs.append(engine.output_processor.append_token(req, token_id))
        if outs[-1].finished:
            break
    final = outs[-1]
    assert final.finish_reason == "stop" and final.text == TEXT[: TEXT.index(stop[0])]
    assert "".join(o.new_text for o in outs) == final.text
    assert all(final.text.startswith(o.text) for o in outs)

    rid = engine.add_request("Hi", SamplingParams(max_tokens=len(ids), stop=("never there",), ignore_eos=True))
    outs = [engine.output_processor.append_token(engine._requests[rid], t) for t in ids[:10]]
    outs.append(engine.abort(rid))  # an aborted request's text has what was held back too
    assert outs[-1].text == engine.tokenizer.decode(ids[:10]) == "".join(o.new_text for o in outs)
    engine.check_integrity()
