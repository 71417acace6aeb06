"""The Python spellings renamed in this release still work until the next one, each with a FutureWarning that
names its new spelling: the verification was `method=` (generate, decode, ServerConfig) and its class
diversed.Method. (The command line's old flags: test_cli; older evaluations' rows: test_evaluation.)"""

import pytest

import diversed
from diversed.decoding.engine import decode
from diversed.generation import generate
from diversed.request import Verification
from diversed.server import ServerConfig

from tiny import toy_pair


@pytest.fixture(scope="module")
def pair():
    return toy_pair()


def test_generate_takes_method_for_verification_with_a_warning(pair):
    options = dict(temperature=0, max_new_tokens=6, draft_length=3, chat=False)
    with pytest.warns(FutureWarning, match=r"generate\(method=\) is now generate\(verification=\)"):
        (old,) = generate(pair, "t3 t4", method="static:0.5", **options)
    (new,) = generate(pair, "t3 t4", verification="static:0.5", **options)
    assert old.tokens == new.tokens and old.metrics["verification"] == "static:0.5"
    with pytest.raises(TypeError, match="method= and verification="):
        generate(pair, "t3 t4", method="exact", verification="exact")


def test_decode_and_server_config_take_method_with_a_warning(pair):
    with pytest.warns(FutureWarning, match=r"decode\(method=\) is now decode\(verification=\)"):
        old = decode(pair.target, [[3, 4]], method=Verification("plain"), max_new_tokens=4)
    assert old.tokens == decode(pair.target, [[3, 4]], verification=Verification("plain"), max_new_tokens=4).tokens
    with pytest.warns(FutureWarning, match=r"ServerConfig\(method=\) is now ServerConfig\(verification=\)"):
        assert ServerConfig(method="lossy:0.3") == ServerConfig(verification="lossy:0.3")


def test_the_class_was_diversed_method():
    with pytest.warns(FutureWarning, match="diversed.Method is now diversed.Verification"):
        assert diversed.Method is Verification


def test_the_drafting_was_draft_length_and_its_speed_schedule_auto(pair):
    """A Drafting (a schedule) was passed as draft_length= and its class was DraftLength; the speed model's
    schedule was "auto", the name that now means the drafter alone; a head was weight_fn=."""
    import diversed.request as request
    from diversed.decoding.engine import Batch

    with pytest.warns(FutureWarning, match="DraftLength is now diversed.request.Drafting"):
        assert request.DraftLength is request.Drafting
    with pytest.warns(FutureWarning, match="draft schedule 'auto' is now 'speed'"):
        assert request.Drafting(2, "auto").schedule == "speed"
    options = dict(temperature=0, max_new_tokens=6, chat=False, verification="exact")
    with pytest.warns(FutureWarning, match=r"draft_length=Drafting\(...\) is now drafting=Drafting\(...\)"):
        (old,) = generate(pair, "t3 t4", draft_length=request.Drafting(3), **options)
    assert old.tokens == generate(pair, "t3 t4", drafting=request.Drafting(3), **options)[0].tokens
    with pytest.raises(ValueError, match="not both"):
        generate(pair, "t3 t4", draft_length=3, drafting=request.Drafting(3))
    with pytest.warns(FutureWarning, match=r"Batch\(draft_length=\) is now Batch\(drafting=\)"):
        Batch(pair.target, None, draft_length=request.Drafting(3))
    with pytest.warns(FutureWarning, match=r"ServerConfig\(draft_length=\) is now ServerConfig\(drafting=\)"):
        ServerConfig(draft_length=request.Drafting(3))
    with pytest.warns(FutureWarning, match=r"generate\(weight_fn=\) is now generate\(head=\)"):
        generate(pair, "t3 t4", draft_length=3, weight_fn=None, **options)
