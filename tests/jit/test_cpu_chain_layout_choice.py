"""An fp32 arena's layout at batch 2-4 chosen by measurement (Note [nChw16c or NHWC by
measurement] in jit/backends/cpu/chain_layout_choice.py): `blocked_inside` under each
policy, the verdict measured once per process and batch, and both pieces built in the
layouts they are named for. Arenas in either layout agree with eager in
test_cpu_chain_native.py / test_cpu_chain_halves.py, which force "always" / "never".
"""

from __future__ import annotations

import pytest
import torch

from dynvm.jit.backends.cpu import chain_layout_choice, onednn_api
from dynvm.jit.calibration import Calibrator, Choice
from tests.jit._onednn import NEEDS_ONEDNN_LIBRARY


def _needs_library(test):
    for mark in NEEDS_ONEDNN_LIBRARY:
        test = mark(test)
    return test


@pytest.mark.parametrize("faster,batch,dtype,blocked", [
    (True, 2, torch.float32, True), (True, 4, torch.float32, True),
    (False, 2, torch.float32, False), (False, 4, torch.float32, False),
    (True, 1, torch.float32, False), (True, 2, torch.bfloat16, False)])
def test_blocked_inside_under_each_policy(faster, batch, dtype, blocked, monkeypatch):
    asked = []

    def measured(dtype_, batch_):
        asked.append((dtype_, batch_))
        return faster
    monkeypatch.setattr(chain_layout_choice, "blocked_measures_faster", measured)
    monkeypatch.setattr(chain_layout_choice, "blocked_policy", "measured")
    assert chain_layout_choice.blocked_inside(dtype, batch) is blocked
    # batch 1 and bf16 are NHWC without asking
    assert asked == ([(dtype, batch)] if batch >= 2 and dtype == torch.float32 else [])
    monkeypatch.setattr(chain_layout_choice, "blocked_policy", "never")
    assert not chain_layout_choice.blocked_inside(dtype, batch)
    monkeypatch.setattr(chain_layout_choice, "blocked_policy", "always")
    forced = batch >= 2 and dtype == torch.float32
    assert chain_layout_choice.blocked_inside(dtype, batch) is forced
    assert len(asked) <= 1      # the forced policies measure nothing


@_needs_library
def test_the_verdict_is_measured_once_per_batch(monkeypatch):
    calibrator = Calibrator("cpu", rounds=3)
    monkeypatch.setattr(chain_layout_choice, "calibrator_for", lambda device: calibrator)
    monkeypatch.setattr(chain_layout_choice, "blocked_policy", "measured")
    first = chain_layout_choice.blocked_inside(torch.float32, 2)
    asked = calibrator.measurements        # a second question only after a yes
    assert asked in (1, 2)
    assert chain_layout_choice.blocked_inside(torch.float32, 2) is first
    assert calibrator.measurements == asked                # cached for the process
    key = (str(torch.float32), 2, torch.get_num_threads())
    choice = calibrator.known(chain_layout_choice.QUESTION, key)
    assert set(choice.seconds) == {chain_layout_choice.NHWC, chain_layout_choice.BLOCKED}
    assert all(s > 0 for s in choice.seconds.values())
    lead = 1.0 - chain_layout_choice.BLOCKED_LEAD
    says = choice.name == chain_layout_choice.BLOCKED and all(
        times[chain_layout_choice.BLOCKED] < lead * times[chain_layout_choice.NHWC]
        for times in (choice.fastest, choice.seconds))
    assert (asked == 2) is says and (not first or says)     # a yes needs both
    chain_layout_choice.blocked_inside(torch.float32, 3)
    assert calibrator.measurements > asked                 # another batch asks again


@_needs_library
def test_the_two_pieces_compute_the_same_convolutions():
    # same weights and input values in each layout: the results are one tensor's two
    # layouts (nChw16c -> NCHW by blocks of 16 channels)
    library = onednn_api.library()
    batch, side, channels = 2, chain_layout_choice._SIDE, chain_layout_choice._EXPANDED
    pieces = {}
    for name, tag in ((chain_layout_choice.NHWC, onednn_api.TAG_NHWC),
                      (chain_layout_choice.BLOCKED, chain_layout_choice.TAG_BLOCKED)):
        pieces[name] = piece = chain_layout_choice._Piece(library, torch.float32, batch, tag)
        source = torch.randn(batch, chain_layout_choice._WIDTH, side, side,
                             generator=torch.Generator().manual_seed(1))
        if name == chain_layout_choice.NHWC:
            piece.buffers[0].copy_(source.permute(0, 2, 3, 1).reshape(-1))
        else:
            blocks = source.reshape(batch, -1, 16, side, side).permute(0, 1, 3, 4, 2)
            piece.buffers[0].copy_(blocks.reshape(-1))
        piece()
    nhwc = pieces[chain_layout_choice.NHWC].buffers[-1].reshape(batch, side, side, channels)
    blocked = pieces[chain_layout_choice.BLOCKED].buffers[-1].reshape(
        batch, channels // 16, side, side, 16)
    assert nhwc.abs().sum() > 0
    torch.testing.assert_close(blocked.permute(0, 2, 3, 1, 4).reshape(nhwc.shape), nhwc,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fastest_blocked,blocked", [(1.0, True), (2.0, False)])
def test_nchw16c_needs_its_median_and_its_fastest_sample_ahead(fastest_blocked, blocked,
                                                               monkeypatch):
    # a median that load on the other core inflated does not choose nChw16c alone
    nhwc, blocked_ = chain_layout_choice.NHWC, chain_layout_choice.BLOCKED
    calibrator = Calibrator("cpu")
    verdict = Choice(blocked_, {nhwc: 3.0, blocked_: 2.0}, nhwc,
                     {nhwc: 2.0, blocked_: fastest_blocked})
    monkeypatch.setattr(calibrator, "known", lambda op, key: verdict)
    assert chain_layout_choice.blocked_measures_faster(torch.float32, 2, calibrator) is blocked


@pytest.mark.parametrize("first,second,blocked", [(True, True, True), (True, False, False),
                                                  (False, True, False)])
def test_nchw16c_needs_a_second_question_to_agree(first, second, blocked, monkeypatch):
    # Note [nChw16c or NHWC by measurement]: one question said nChw16c in 4 of 21
    # processes (the arena then has no pieces); the second is asked only after a yes
    nhwc, blocked_ = chain_layout_choice.NHWC, chain_layout_choice.BLOCKED
    calibrator = Calibrator("cpu")
    asked = []

    def known(op, key):
        asked.append(key)
        says = first if len(asked) == 1 else second
        return Choice(blocked_ if says else nhwc, {nhwc: 3.0, blocked_: 2.0 if says else 4.0},
                      nhwc, {nhwc: 2.0, blocked_: 1.0 if says else 4.0})
    monkeypatch.setattr(calibrator, "known", known)
    assert chain_layout_choice.blocked_measures_faster(torch.float32, 2, calibrator) is blocked
    assert len(asked) == (2 if first else 1)
    assert len(set(asked)) == len(asked)        # the second is a question of its own


@pytest.mark.parametrize("median_blocked,blocked", [(2.0, True), (2.7, False)])
def test_nchw16c_needs_a_lead_beyond_the_pieces_it_costs(median_blocked, blocked,
                                                         monkeypatch):
    # Note [nChw16c or NHWC by measurement]: `BLOCKED_LEAD`, median and fastest sample
    nhwc, blocked_ = chain_layout_choice.NHWC, chain_layout_choice.BLOCKED
    calibrator = Calibrator("cpu")
    verdict = Choice(blocked_, {nhwc: 3.0, blocked_: median_blocked}, nhwc,
                     {nhwc: 2.0, blocked_: 1.0})
    monkeypatch.setattr(calibrator, "known", lambda op, key: verdict)
    assert chain_layout_choice.blocked_measures_faster(torch.float32, 2, calibrator) is blocked
