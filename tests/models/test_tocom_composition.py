"""The shipped DeiT-Tiny compensator on the real weights: composing 0 -> 8 and then 8 -> 16 gives the weights
of 0 -> 16 (to fp32 round-off), and switching back and forth 100 times does not drift."""

import pytest
import torch

from timm_tokcomp.tocom import attach, compensate, detach, load, set_compression
from conftest import REPO, real_model_and_images

SHIPPED = REPO / "hub_cards" / "deit_tiny_patch16_224-tocom"
pytestmark = [pytest.mark.slow, pytest.mark.realdata]


def _qkv(model):
    return [blk.attn.qkv.weight.detach().clone() for blk in model.blocks]


def test_composing_two_steps_equals_the_direct_step_on_real_weights():
    comp, _ = load(str(SHIPPED))
    model, _ = real_model_and_images("deit_tiny_patch16_224", 1)
    attach(model, comp, source_r=0)
    compensate(model, 16)
    direct = _qkv(model)
    compensate(model, 8)
    detach(model, restore=False)  # keep the 0 -> 8 weights: they are the source of the next step
    attach(model, comp, source_r=8)
    compensate(model, 16)
    for two_steps, one_step in zip(_qkv(model), direct):
        torch.testing.assert_close(two_steps, one_step, rtol=0, atol=1e-6)


def test_switching_100_times_does_not_drift_on_real_weights():
    comp, _ = load(str(SHIPPED))
    model, images = real_model_and_images("deit_tiny_patch16_224", 4)
    original = _qkv(model)
    attach(model, comp, source_r=0)
    set_compression(model, r=16)
    first_weights = _qkv(model)
    with torch.no_grad():
        first_logits = model(images)
    for i in range(100):
        set_compression(model, r=0 if i % 2 == 0 else 16)
    assert all(torch.equal(a, b) for a, b in zip(_qkv(model), first_weights))
    with torch.no_grad():
        assert torch.equal(model(images), first_logits)
    set_compression(model, r=0)
    assert all(torch.equal(a, b) for a, b in zip(_qkv(model), original))
