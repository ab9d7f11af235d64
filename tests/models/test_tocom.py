"""ToCom compensator math and runtime switching."""
import pytest
import torch

import timm_tokcomp
from timm_tokcomp.tocom import Compensator, attach, detach, set_compression
from conftest import SMALL, _random_compensator, make_model


def test_delta_is_the_signed_scaled_sum_of_the_steps_between():
    comp = _random_compensator()
    expected = torch.zeros(SMALL["depth"], 2, SMALL["embed_dim"], SMALL["embed_dim"])
    for i in range(3, 7):
        expected += comp.lora_b[i] @ comp.lora_a[i]
    torch.testing.assert_close(comp.delta(3, 7), 0.1 * expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comp.delta(7, 3), -0.1 * expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comp.delta(3, 7, scale=0.05), 0.05 * expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(comp.delta(5, 5), torch.zeros_like(expected))
    # composition: (0 -> 16) = (0 -> 8) + (8 -> 16)
    torch.testing.assert_close(comp.delta(0, 16), comp.delta(0, 8) + comp.delta(8, 16), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_switching_is_exact_and_reversible(dtype):
    model = make_model("cls").to(dtype)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    attach(model, _random_compensator(), source_r=4)
    at = {}
    for r in (16, 0, 8, 16, 4, 8, 0, 16):
        set_compression(model, r=r)
        assert timm_tokcomp.get_reducer(model).r == r
        weight = model.blocks[1].attn.qkv.weight.detach().clone()
        if r in at:
            assert torch.equal(weight, at[r])  # bit-identical every time
        at[r] = weight
        d = SMALL["embed_dim"]
        assert torch.equal(weight[d:2 * d], original["blocks.1.attn.qkv.weight"][d:2 * d])  # keys untouched
    set_compression(model, r=4)
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())
    set_compression(model, r=12)
    detach(model)
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())


def test_compensated_weights_equal_the_formula():
    model = make_model("attn_dim")  # attn_dim = 3 heads * 8 != embed_dim
    w0 = model.blocks[2].attn.qkv.weight.detach().clone()
    comp = _random_compensator(attn_dim=24)
    attach(model, comp, source_r=2)
    set_compression(model, r=9)
    delta = comp.delta(2, 9)[2]
    w = model.blocks[2].attn.qkv.weight
    torch.testing.assert_close(w[:24], w0[:24] + delta[0])
    torch.testing.assert_close(w[48:], w0[48:] + delta[1])
    assert torch.equal(w[24:48], w0[24:48])


def test_works_with_evit_and_applies_tome_to_a_plain_model(images):
    model = timm_tokcomp.apply(make_model("cls"), "evit", r=2)
    attach(model, _random_compensator())
    set_compression(model, r=5)
    assert timm_tokcomp.get_reducer(model).name == "evit" and timm_tokcomp.get_reducer(model).r == 5
    plain = attach(make_model("cls"), _random_compensator())
    set_compression(plain, r=3)
    assert timm_tokcomp.get_reducer(plain).name == "tome"
    with torch.no_grad():
        assert plain(images).shape == (3, SMALL["num_classes"])


def test_misfits_and_bad_degrees_are_named():
    with pytest.raises(ValueError, match="depth 3 does not match the model's 4 blocks"):
        attach(make_model("cls"), _random_compensator(depth=3))
    with pytest.raises(ValueError, match="width 32"):
        attach(make_model("cls"), _random_compensator(dim=32))
    model = attach(make_model("cls"), _random_compensator(steps=8))
    with pytest.raises(ValueError, match=r"r must be an int in \[0, 8\]"):
        set_compression(model, r=9)
    with pytest.raises(ValueError, match="no compensator"):
        set_compression(make_model("cls"), r=1)
    with pytest.raises(ValueError, match="lora_a must be"):
        Compensator(torch.zeros(16, 4, 2, 2, 48), torch.zeros(16, 4, 2, 48, 3))



def test_set_compression_refuses_a_method_without_r():
    model = make_model("cls")
    timm_tokcomp.apply(model, "atm")
    attach(model, _random_compensator())
    with pytest.raises(ValueError, match="runs 'atm'"):
        set_compression(model, r=8)


def test_a_compensated_model_saved_and_loaded_whole_still_detaches():
    """torch.save / torch.load (and deepcopy) give new tensors at version 0: the guard compares the weights' values,
    so an untouched round trip detaches to the pristine weights, and a trained one is still refused."""
    import copy
    import io

    model = make_model("cls")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attach(model, _random_compensator())
    set_compression(model, 8)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    for loaded in (torch.load(io.BytesIO(buffer.getvalue()), weights_only=False), copy.deepcopy(model)):
        detach(loaded)
        for key, value in loaded.state_dict().items():
            torch.testing.assert_close(value, before[key], rtol=0, atol=1e-6)
    trained = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    with torch.no_grad():
        trained.blocks[1].attn.qkv.weight[0, 0] += 0.5
    with pytest.raises(ValueError, match=r"blocks\[1\].attn.qkv.weight changed since"):
        detach(trained)


def test_detach_gives_back_the_model_as_it_was_at_attach():
    """Weights and method: a plain model comes back plain (set_compression had applied ToMe), a reduced one with
    its own method and parameters; restore=False keeps both as they are."""
    plain = make_model("cls")
    attach(plain, _random_compensator(), source_r=0)
    set_compression(plain, r=8)
    detach(plain)
    assert not timm_tokcomp.is_reduced(plain)
    reduced = timm_tokcomp.apply(make_model("cls"), "evit", r=2, prop_attn=True)
    attach(reduced, _random_compensator(), source_r=2)
    set_compression(reduced, r=8)
    detach(reduced)
    reducer = timm_tokcomp.get_reducer(reduced)
    assert (reducer.name, reducer.r, reducer.prop_attn) == ("evit", 2, True)
    kept = make_model("cls")
    attach(kept, _random_compensator(), source_r=0)
    set_compression(kept, r=8)
    detach(kept, restore=False)
    assert timm_tokcomp.get_reducer(kept).r == 8


def test_a_scale_beyond_any_trained_one_is_refused_before_it_overflows_a_forward():
    """Trained scales are about 0.1; a finite but huge one (hypothesis found 5e18) made every output NaN."""
    model = make_model("cls")
    attach(model, _random_compensator(seed=3))
    with pytest.raises(ValueError, match=r"scale must be a finite number in \[-1000, 1000\]"):
        set_compression(model, 3, scale=5e18)
    set_compression(model, 3, scale=-1000.0)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(2, 3, 32, 32))).all()
