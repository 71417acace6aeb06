"""Draft-length schedules: the running speed model behind the "auto" schedule, and the phase profile."""

import pytest
import torch
from closed_forms import expected_tokens_per_round

from diversed.backends.hf import TransformersModel
from diversed.backends.llama_cpp import LlamaCppModel
from diversed.decoding.drafters.base import Candidate, DraftRound
from diversed.decoding.profile import PHASES, profile_table
from diversed.decoding.schedule import CostMemory, SpeedModel
from diversed.decoding.scheduler import copy_width
from diversed.request import Drafting


def observed(kept_of_five: list[int], step: float, verify: dict[int, float], plain: float | None = None
             ) -> SpeedModel:
    """A speed model after rounds of 5 drafts (kept counts given) with these draft-step and verify times, and
    a step of the target alone timed at `plain` if given."""
    model = SpeedModel(maximum=16, decay=1.0, prior_drafts=0.0)
    for i, kept in enumerate(kept_of_five):
        k = list(verify)[i % len(verify)]
        model.observe([kept], [5], 5, 5 * step, k, verify[k])
    if plain is not None:
        model.observe_plain(plain)
    return model


def test_verify_times_per_width_and_acceptance_are_recovered_from_rounds():
    model = observed([5, 3, 5, 4], step=0.1, verify={4: 0.3, 8: 0.5})
    assert model.verify_time(4) == pytest.approx(0.3) and model.verify_time(8) == pytest.approx(0.5)
    assert model.verify_time(6) == pytest.approx(0.4) and model.verify_time(10) == pytest.approx(0.6)  # the line
    assert model.acceptance == pytest.approx(17 / 19)  # 17 kept drafts, 2 rejections
    n = 6
    assert model.tokens_per_second(n) == pytest.approx(expected_tokens_per_round([17 / 19] * n) / (n * 0.1 + 0.45))


def test_a_width_that_costs_more_than_the_line_says_is_avoided():
    """llama.cpp on 2 cores: a pass over 8 tokens costs far more than the line through 4 and 12 suggests."""
    model = observed([5] * 8, step=0.01, verify={4: 0.135, 8: 0.333, 12: 0.39}, plain=0.06)
    assert model.verify_time(8) == pytest.approx(0.333)
    assert model.best_length() not in (0, 7)


def test_wide_passes_are_priced_by_one_line_so_that_one_slow_timing_bars_no_width():
    """A pass over 32 tokens timed once on a busy moment: the weighted line through every pass of WIDE tokens
    or more prices it, as it prices the wide widths never timed; narrower ones keep their own means."""
    model = SpeedModel(maximum=64, decay=1.0, prior_drafts=0.0)
    for k, seconds in ((1, 0.07), (4, 0.13), (16, 0.30), (32, 0.62), (48, 0.70), (48, 0.70)):
        model.observe_copied(k, seconds)
    # weights 1, 1, 2 at 16, 32, 48: mean width 36, mean time 0.58, slope 8.32 / 704 per token
    slope = 8.32 / 704
    assert model.verify_time(32) == pytest.approx(0.58 - 4 * slope) and model.verify_time(32) < 0.62
    assert model.verify_time(64) == pytest.approx(0.58 + 28 * slope)
    assert model.verify_time(4) == pytest.approx(0.13) and model.verify_time(1) == pytest.approx(0.07)


def test_with_a_tile_passes_of_its_width_or_more_are_whole_tiles():
    model = SpeedModel(maximum=64, tile=16)
    assert model.draft_lengths() == [*range(1, 15), 15, 31, 47, 63]  # passes of 2-15 tokens, then 16, 32, 48, 64
    assert model.draft_lengths(40) == [*range(1, 15), 15, 31]
    assert SpeedModel(maximum=8).draft_lengths() == list(range(1, 9))  # no tile: every length


def test_a_long_copy_is_drafted_in_whole_tiles_where_the_line_would_go_past_one():
    """llama.cpp on a CPU: a pass over 64 tokens costs less than one over 65, which the line through the timed
    wide passes cannot show. Where every copied draft is kept, the line alone picks the widest pass; with the
    tile, a whole number of tiles."""
    costs = ((1, 0.035), (4, 0.10), (8, 0.23), (16, 0.28), (32, 0.47), (48, 0.66), (64, 0.82))
    widths = {}
    for tile in (1, 16):
        model = SpeedModel(maximum=64, decay=1.0, prior_drafts=0.0, tile=tile)
        for k, seconds in costs:
            model.observe_copied(k, seconds)
        copy = Candidate(list(range(100)), ("run", 64), 0.999)
        widths[tile] = copy_width([copy], model)[0] + 1
    assert widths == {1: 65, 16: 64}


def test_the_llama_cpp_backend_declares_its_tile_and_transformers_none():
    assert LlamaCppModel.pass_tile == 16 and TransformersModel.pass_tile == 1


def test_cheap_accepted_drafts_get_long_rounds_and_costly_rejected_ones_the_target_alone():
    cheap = observed([5] * 19 + [4], step=0.01, verify={6: 0.3, 3: 0.27}, plain=0.25)
    costly = observed([0, 1, 0, 0], step=0.2, verify={6: 0.3, 3: 0.27}, plain=0.25)
    assert cheap.best_length() >= 10 and costly.best_length() == 0
    assert cheap.best_length() == max(range(0, 17), key=cheap.tokens_per_second)


def test_the_target_alone_probes_drafting_again_every_few_rounds():
    """A CPU where a verify pass costs nearly a step per token: the target alone wins at 60% acceptance,
    and after probe_every plain steps one drafted round measures acceptance again."""
    model = SpeedModel(maximum=8, decay=1.0, prior_drafts=0.0, probe_every=4)
    for k in (2, 4):
        model.observe([1], [k - 1], k - 1, 0.022 * (k - 1), k, 0.032 + 0.025 * k)
    model.observe_plain(0.057)
    assert model.best_length() == 0
    for _ in range(3):
        model.observe_plain(0.057)
    assert model.best_length() >= 1  # the probe
    model.observe([0], [3], 3, 0.066, 4, 0.135)  # the probe's drafts were rejected
    assert model.plain_rounds == 0 and model.best_length() == 0
    for _ in range(4):
        model.observe_plain(0.057)
    assert model.best_length() == 0  # the probe did not pay: the next one waits twice as long
    for _ in range(4):
        model.observe_plain(0.057)
    assert model.best_length() >= 1


def test_a_step_of_the_target_alone_is_timed_before_the_extrapolation_is_trusted():
    model = observed([5, 5], step=0.01, verify={3: 0.1})
    assert model.best_length() == 0 and 1 not in model.width


def test_with_no_draft_step_timed_one_draft_is_tried():
    """A batch that grew starts a speed model for its new size: target steps timed, no draft step yet (or
    only catch-up rounds, which time none)."""
    model = SpeedModel(maximum=8)
    model.observe_plain(0.04)
    model.observe([2], [2], 2, None, 3, 0.08)
    assert model.best_length() == 1


def test_no_probe_where_even_drafts_all_kept_would_be_slower():
    """A verify pass costing a step per token and a costly draft: no acceptance can make drafting pay."""
    model = SpeedModel(maximum=8, decay=1.0, prior_drafts=0.0, probe_every=2)
    model.observe([1], [1], 1, 0.03, 2, 0.08)
    model.observe([2], [2], 2, 0.06, 3, 0.12)
    for _ in range(10):
        model.observe_plain(0.04)
        assert model.best_length() == 0


def test_a_single_verify_length_is_taken_as_flat_and_the_prior_keeps_acceptance_below_one():
    model = SpeedModel(maximum=8)
    model.observe([5], [5], 5, 0.05, 6, 0.3)
    assert model.verify_time(2) == model.verify_time(9) == pytest.approx(0.3)
    assert 0.8 < model.acceptance < 1.0


def test_auto_schedule_may_start_above_the_first_length_but_constant_needs_no_maximum():
    assert Drafting(20).longest == 20  # transformers' default length is allowed as a constant
    assert Drafting(3, "speed").longest == 16
    with pytest.raises(ValueError, match="draft_length"):
        Drafting(20, "speed")


def test_profile_table_lists_every_phase_and_the_total():
    profile = dict.fromkeys(PHASES, 0.5) | {"total": 3.5, "rounds": 7}
    table = profile_table(profile)
    assert all(phase in table for phase in PHASES)
    assert "14.3%" in table and "500.0" in table and "(7 rounds)" in table


@pytest.fixture
def fresh_costs(tmp_path):
    """An empty memory of costs, kept in a file of its own."""
    return CostMemory(tmp_path / "speed-costs.json")


def test_costs_of_named_models_outlive_the_process(fresh_costs):
    model = observed([5, 5], step=0.01, verify={3: 0.1})
    model.observe_plain(0.05)
    fresh_costs.keep(("target.gguf", "draft.gguf", 1), model)
    fresh_costs.keep((1234, 5678, 1), model)  # models known only by id(): this process only
    fresh_costs.save()
    assert fresh_costs.path.is_file()
    later_process = CostMemory(fresh_costs.path)
    later = later_process.speed_model(("target.gguf", "draft.gguf", 1), 8)
    assert later.verify_time(3) == pytest.approx(model.verify_time(3)) and later.draft_steps
    assert 1 not in later.width and later.best_length() == 0  # a step of the target alone is timed afresh
    later.observe_plain(0.04)
    assert later.verify_time(1) == pytest.approx(0.04) and later.draft_steps and len(later.width) == 2
    assert not later_process.speed_model((1234, 5678, 1), 8).width
    assert fresh_costs.speed_model((1234, 5678, 1), 8).verify_time(3) == pytest.approx(model.verify_time(3))


def test_widths_timed_by_copying_alone_are_remembered(fresh_costs):
    """A call whose drafts cost nothing (lookup, the suffix cache) times verify widths but no draft step: the
    next call starts from those widths, not from the guess that a wide pass costs what a narrow one does."""
    model = SpeedModel(maximum=8)
    model.observe_plain(0.03)
    model.observe_copied(3, 0.06)
    fresh_costs.keep(("target.gguf", "", 1), model)
    fresh_costs.save()
    later = CostMemory(fresh_costs.path).speed_model(("target.gguf", "", 1), 8)
    later.observe_plain(0.03)
    assert later.verify_time(3) == pytest.approx(0.06) and not later.draft_steps


def test_an_unreadable_costs_file_is_measured_afresh(fresh_costs):
    fresh_costs.path.write_text("{not json")
    fresh = fresh_costs.speed_model(("target.gguf", "draft.gguf", 1), 8)
    assert not fresh.width and not fresh.draft_steps
    model = observed([5, 5], step=0.01, verify={3: 0.1})
    model.observe_plain(0.05)
    fresh_costs.keep(("target.gguf", "draft.gguf", 1), model)
    fresh_costs.save()  # replaces the broken file
    assert CostMemory(fresh_costs.path).speed_model(("target.gguf", "draft.gguf", 1), 8).draft_steps


def test_a_width_timed_slow_once_is_bounded_and_then_forgotten():
    """A remembered pass over 3 tokens timed on a busy machine (3 s) cannot keep drafting from being tried:
    it is bounded by three passes over one, and read off the line again once it goes untimed."""
    model = SpeedModel(maximum=8)
    model.observe_plain(0.04)
    model.width[3] = [1.0, 3.0]
    assert model.verify_time(3) == pytest.approx(0.12)
    for _ in range(30):
        model.observe_plain(0.04)  # steps of the target alone: the remembered widths stay
    assert 3 in model.width
    for _ in range(30):
        model.observe_copied(2, 0.05)
    assert 3 not in model.width and model.verify_time(3) < 0.12


def test_the_draft_models_catch_up_is_priced_per_token():
    model = SpeedModel(maximum=8)
    assert model.catch_up_time(100) == float("inf")  # nothing timed: never chosen for a long catch-up
    model.observe([2], [2], 2, 0.05, 3, 0.08)
    assert model.catch_up_time(100) == pytest.approx(100 * 0.025) and model.catch_up_time(2) == 0.0
    model.observe_catch_up(50, 0.25)
    assert model.catch_up_time(100) == pytest.approx(0.5)
    assert model.tokens_per_second(2, overhead=0.5) < model.tokens_per_second(2)


@pytest.mark.parametrize("history, drafts", [(40, True), (600, False)])
def test_an_untimed_draft_model_is_tried_only_on_a_short_catch_up(history, drafts):
    """Under the speed schedule the auto drafter times a draft model it has no costs for by drafting with it,
    which first feeds it every token it has not seen: worth it over a prompt, not over a conversation's history
    (on a CPU that catch-up stalls every row for longer than a short answer gains)."""
    from diversed.decoding.drafters import make_drafter
    from diversed.decoding.scheduler import UNTIMED_CATCH_UP, Scheduler

    from tiny import tiny_model

    assert 40 < UNTIMED_CATCH_UP < 600
    drafter = make_drafter("auto", TransformersModel(tiny_model(0), cache_mib=0), capacity=1)
    # A last token the prompt has nowhere else: nothing to copy
    drafter.add(torch.randint(3, 90, (history - 1,), generator=torch.Generator().manual_seed(0)).tolist() + [95])
    scheduler = Scheduler(Drafting(3, "speed", maximum=4))
    scheduler.begin(("tiny",), 1, joined=True)
    scheduler.observe_step(0.05, prefill=False)  # a step of the target alone, timed; no draft step yet
    ask = DraftRound([4], ["auto"], lambda logits: (logits.argmax(-1), logits.softmax(-1)), timed=True)
    proposal = scheduler.propose(drafter, ask)
    assert (proposal is not None and proposal.forwards > 0) == drafts
