"""Representation Shift: the patched model against a reference written directly over timm's blocks (each branch's
output norm ranks the patch tokens, the least shifted are dropped right after the layer measured), attention left
untouched, padding ranked last, and the parameter's refusal."""
import pytest
import torch

import timm_tokcomp
from timm_tokcomp.methods.repshift import RepShift, shift_pruning
from conftest import make_model


def _reference(model, images, r, shift_at):
    """timm's blocks run one by one; after each block's measured layer the r patch tokens of least shift go."""
    x = model._pos_embed(model.patch_embed(images))
    p = model.num_prefix_tokens

    def drop(x, shift):
        keep = shift[:, p:].argsort(dim=-1, descending=True, stable=True)[:, : x.shape[1] - p - r].sort(dim=-1).values
        return torch.cat([x[:, :p], x[:, p:].gather(1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))], dim=1)

    for blk in model.blocks:
        h = blk.drop_path1(blk.ls1(blk.attn(blk.norm1(x))))
        x = x + h
        if shift_at == "attn":
            x = drop(x, h.norm(dim=-1))
        m = blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
        x = x + m
        if shift_at != "attn":
            x = drop(x, (m if shift_at == "mlp" else h + m).norm(dim=-1))
    return model.forward_head(model.norm(x))


@pytest.mark.parametrize("shift_at", ["mlp", "attn", "block"])
@pytest.mark.parametrize("variant", ["cls", "layerscale_qknorm"])
def test_equals_a_reference_over_timms_blocks(variant, shift_at, images):
    plain = make_model(variant)
    model = timm_tokcomp.apply(make_model(variant), "repshift", r=5, shift_at=shift_at, prefix_only_last_block=False)
    with torch.no_grad():
        torch.testing.assert_close(model(images), _reference(plain, images, 5, shift_at), rtol=1e-5, atol=1e-5)
    assert timm_tokcomp.last_stats(model).tokens_per_block == [65, 60, 55, 50]


def test_attention_is_left_alone(images, monkeypatch):
    """The reducer reads no attention: its attention hook is never called, and timm's fused attention stays."""
    model = timm_tokcomp.apply(make_model("cls"), "repshift", r=4)

    def refuse(*args, **kwargs):
        raise AssertionError("RepShift asked attention for a metric")

    monkeypatch.setattr(RepShift, "attention_metric", refuse)
    with torch.no_grad():
        out = model(images)
    assert torch.isfinite(out).all() and timm_tokcomp.last_stats(model).tokens_out == 65 - 4 * 4


def test_padding_ranks_below_every_real_token():
    shift = torch.tensor([[9.0, 5.0, 7.0, 1.0, 8.0]])  # prefix, then four patch tokens
    size = torch.tensor([[[1.0], [1.0], [0.0], [1.0], [0.0]]])  # two of them padding
    plan = shift_pruning(shift, 2, 1, size)
    assert plan.keep_idx.tolist() == [[0, 2]]  # the real ones (shifts 5 and 1), not the padding (7, 8)
    assert shift_pruning(shift, 2, 1, None).keep_idx.tolist() == [[1, 3]]  # without sizes: shifts 7 and 8


def test_shift_at_is_checked():
    with pytest.raises(ValueError, match="shift_at must be one of block, mlp, attn"):
        RepShift(r=4, shift_at="qkv")
    assert RepShift(r=4, shift_at="attn").reduces_at == "after_attention"
    assert RepShift(keep_rate=0.7, shift_at="attn").reduces_at == "after_mlp"  # the study's place
    assert RepShift(r=4).reduces_at == "after_mlp" and RepShift(r=4).shift_at == "block"
