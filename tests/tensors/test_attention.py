"""Proportional-attention implementations (timm_tokcomp.ops.attention): each equals the float-mask reference, in the
attention step and on whole models; 'auto' resolves from the device table; the padded qkv follows its weights."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import timm_tokcomp
from timm_tokcomp.ops import attention
from timm_tokcomp.measure import device_table
from conftest import make_model

IMPLS = list(attention.PROP_ATTN_IMPLS)
FOLDED = [i for i in IMPLS if i != "mask"]


@pytest.fixture(autouse=True)
def _quiet_flex():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


@pytest.mark.parametrize("d", [8, 12, 64])
def test_fold_equals_the_float_mask(d):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 3, 11, d).unbind(0)
    log_size = torch.rand(2, 1, 1, 11).mul(5).add(0.5).log()
    log_size[1, ..., 4] = float("-inf")  # a size-0 padding token (ATS) stays out of attention
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=log_size)
    q2, k2, v2 = attention.fold_qk(q, k, v, log_size, d ** -0.5)
    assert q2.shape[-1] % 8 == 0 and q2.shape[-1] > d
    torch.testing.assert_close(attention.padded_attention(q2, k2, v2, d, 0.0), reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(attention.flex_attention(q, k, v, log_size, d ** -0.5), reference, atol=1e-5, rtol=0)


def _logits(model, x):
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("variant", ["cls", "distilled", "registers", "avgpool_noclass", "attn_dim"])
@pytest.mark.parametrize("impl", FOLDED)
@pytest.mark.parametrize("method,params", [("tome", {"r": 4}), ("evit", {"r": 3}), ("pyra", {"r": 4}), ("tome", {"keep_rate": 0.7, "stages": (2, 3, 4)})])
def test_models_match_the_mask_path(variant, impl, method, params, images):
    if method == "evit" and variant == "avgpool_noclass":
        pytest.skip("EViT needs a class token")
    base = make_model(variant)
    reference = _logits(timm_tokcomp.apply(copy.deepcopy(base), method, prop_attn="mask", **params), images)
    model = timm_tokcomp.apply(copy.deepcopy(base), method, prop_attn=impl, **params)
    torch.testing.assert_close(_logits(model, images), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", FOLDED)
def test_padding_tokens_of_ats_stay_masked(impl, images):
    base = make_model("cls")
    reference = _logits(timm_tokcomp.apply(copy.deepcopy(base), "ats", r=6, prop_attn="mask"), images)
    torch.testing.assert_close(_logits(timm_tokcomp.apply(copy.deepcopy(base), "ats", r=6, prop_attn=impl), images),
                               reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", IMPLS + ["auto", True])
def test_r0_equals_the_plain_model(impl, images):
    base = make_model("cls")
    plain = _logits(base, images)
    assert torch.equal(_logits(timm_tokcomp.apply(copy.deepcopy(base), "tome", r=0, prop_attn=impl), images), plain)


def test_fold_qkv_refuses_qk_norm_and_names_the_alternative():
    model = make_model("layerscale_qknorm")
    with pytest.raises(ValueError, match=r"fold_qkv' needs attention without q / k norm \(blocks\[0\].attn.*'fold'"):
        timm_tokcomp.apply(model, "tome", r=2, prop_attn="fold_qkv")
    assert not timm_tokcomp.is_reduced(model)


@pytest.mark.parametrize("value", ["yes", "Mask", 1, 0.5, "torch"])
def test_bad_values_are_refused(value):
    with pytest.raises(ValueError, match="prop_attn must be True, False, None"):
        timm_tokcomp.apply(make_model("cls"), "tome", r=2, prop_attn=value)


@pytest.mark.parametrize("impl", ["fold", "fold_qkv"])  # flex: compiled only (the op counter cannot enter it)
def test_no_host_wait_even_on_a_first_forward(impl, images):
    """A fresh model's first forward builds its padded qkv without reading the host."""
    from timm_tokcomp.measure.counting import OpCounter

    model = timm_tokcomp.apply(make_model("cls"), "tome", r=4, prop_attn=impl)
    with torch.no_grad(), OpCounter() as ops:
        model(images)
    assert ops.sync_counts == {}


def test_padded_qkv_follows_weights_changed_in_place(images):
    base = make_model("cls")
    model = timm_tokcomp.apply(copy.deepcopy(base), "tome", r=4, prop_attn="fold_qkv")
    _logits(model, images)  # builds the padded weights
    new = {k: v * 1.1 if k.endswith("attn.qkv.weight") else v for k, v in base.state_dict().items()}
    model.load_state_dict(new)
    base.load_state_dict(new)
    reference = _logits(timm_tokcomp.apply(base, "tome", r=4, prop_attn="mask"), images)
    torch.testing.assert_close(_logits(model, images), reference, atol=1e-5, rtol=0)


# Every implementation computes with what attn.qkv gives when called, never with a copy of its weights: whatever
# wraps or changes the projection (an unmerged adapter, hooks, quantisation, weights edited through .data) runs.

def _both(base, impl, images):
    """(logits on the float-mask path, logits on impl) of two copies of base reduced by ToMe r=4."""
    reference = _logits(timm_tokcomp.apply(copy.deepcopy(base), "tome", r=4, prop_attn="mask"), images)
    return reference, _logits(timm_tokcomp.apply(copy.deepcopy(base), "tome", r=4, prop_attn=impl), images)


def _lora(model):
    """model with an unmerged peft LoRA on every attn.qkv, B drawn at random so that it changes the outputs."""
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["qkv"], lora_alpha=4))
    torch.manual_seed(3)
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return wrapped.base_model.model


@pytest.mark.parametrize("impl", FOLDED)
def test_an_unmerged_lora_on_qkv_is_applied(impl, images):
    model = _lora(make_model("cls"))
    reference, got = _both(model, impl, images)
    plain = _logits(timm_tokcomp.apply(make_model("cls"), "tome", r=4, prop_attn="mask"), images)
    assert (reference - plain).abs().max() > 1e-2  # the adapter changes the outputs
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", FOLDED)
def test_the_lora_of_every_block_trains(impl, images):
    model = timm_tokcomp.apply(_lora(make_model("cls")).train(), "tome", r=4, prop_attn=impl)
    model(images).square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_B" in n}
    assert len(grads) == len(model.blocks)
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), \
        [n for n, g in grads.items() if g is None or g.abs().sum() == 0]


@pytest.mark.parametrize("impl", FOLDED)
def test_forward_hooks_on_qkv_run(impl, images):
    base, calls = make_model("cls"), []

    def shift(module, args, output):
        calls.append(module)
        return output + 0.5

    for blk in base.blocks:
        blk.attn.qkv.register_forward_hook(shift)
    reference, got = _both(base, impl, images)
    assert len(calls) == 2 * len(base.blocks)  # once per block in each of the two models
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", FOLDED)
def test_a_dynamically_quantised_model_runs(impl, images):
    quantize_dynamic = pytest.importorskip("torch.ao.quantization").quantize_dynamic
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation
        base = quantize_dynamic(make_model("cls"), {torch.nn.Linear}, dtype=torch.qint8)
    reference, got = _both(base, impl, images)
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("impl", FOLDED)
def test_weights_edited_through_data_after_a_forward_are_read(impl, images):
    base = make_model("cls")
    model = timm_tokcomp.apply(copy.deepcopy(base), "tome", r=4, prop_attn=impl)
    _logits(model, images)
    for a, b in zip(model.blocks, base.blocks):
        for blk in (a, b):
            blk.attn.qkv.weight.data.mul_(1.5)  # .data: no version bump
    reference = _logits(timm_tokcomp.apply(base, "tome", r=4, prop_attn="mask"), images)
    torch.testing.assert_close(_logits(model, images), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", FOLDED)
def test_a_forward_under_inference_mode_leaves_gradients_possible(impl, images):
    """A frozen model first run under inference_mode, then differentiated with respect to its input (a saliency
    map): nothing made under inference_mode may enter the later graph."""
    grads = {}
    for name in ("mask", impl):
        model = timm_tokcomp.apply(make_model("cls").requires_grad_(False), "tome", r=4, prop_attn=name)
        with torch.inference_mode():
            model(images)
        x = images.clone().requires_grad_(True)
        model(x).square().sum().backward()
        grads[name] = x.grad
    torch.testing.assert_close(grads[impl], grads["mask"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", FOLDED)
def test_gradients_reach_the_qkv_weights_as_on_the_mask_path(impl, images):
    grads = {}
    for name in ("mask", impl):
        model = timm_tokcomp.apply(make_model("cls").train(), "tome", r=4, prop_attn=name)
        model(images).square().sum().backward()
        grads[name] = model.blocks[2].attn.qkv.weight.grad
    torch.testing.assert_close(grads[impl], grads["mask"], atol=1e-5, rtol=1e-4)


def test_auto_resolves_from_the_device_table(monkeypatch, images):
    calls = []
    for name in ("fold_qk", "folded_qkv"):
        real = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    model = timm_tokcomp.apply(make_model("cls"), "tome", r=4, prop_attn=True)
    _logits(model, images)
    assert calls == []  # no entry for the CPU in fp32: the float mask
    table = {("cpu", "fp32"): {"prop_attn": "fold_qkv", "kernel": "torch"}}
    monkeypatch.setattr(device_table, "_entries", lambda path=None: table)
    _logits(model, images)
    assert calls and set(calls) == {"folded_qkv"}
    assert device_table.measured("prop_attn", images.bfloat16()) is None  # another precision: no entry


def test_compiled_blocks_without_rope_take_the_tables_compiled_choice(monkeypatch, images):
    from conftest import family_model
    from timm_tokcomp.runtime import compile as compiling

    calls = []
    real = attention.fold_qk
    monkeypatch.setattr(attention, "fold_qk", lambda *a: calls.append("fold") or real(*a))
    table = {("cpu", "fp32"): {"prop_attn": "mask", "prop_attn_compiled": "fold"}}
    monkeypatch.setattr(device_table, "_entries", lambda path=None: table)
    model = timm_tokcomp.apply(make_model("cls"), "tome", r=4, prop_attn=True)
    eager = _logits(model, images)
    assert calls == []  # eager: the table's prop_attn
    with torch.no_grad():
        torch.testing.assert_close(compiling.compile(model, backend="eager")(images), eager, atol=1e-5, rtol=0)
    assert calls  # compiled: its prop_attn_compiled
    calls.clear()
    rope = timm_tokcomp.apply(family_model("eva02_cat_swiglu"), "tome", r=4, prop_attn=True)
    with torch.no_grad():
        compiling.compile(rope, backend="eager")(images)
    assert calls == []  # a rope model keeps the table's prop_attn when compiled


def test_flex_compiled_by_inductor_on_the_cpu_is_the_mask():
    """Inductor's CPU FlexAttention cannot read the bias tensor (a LoweringException on torch 2.14): the float mask
    serves there, with the same result."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, 9, 8).unbind(0)
    bias = torch.rand(2, 1, 1, 9).add(0.5).log()
    no_dropout = torch.nn.Dropout(0.0)
    compiled = torch.compile(lambda *t: attention.attend(*t, "flex", 8 ** -0.5, no_dropout, True), fullgraph=True)
    reference = attention.attend(q, k, v, bias, "mask", 8 ** -0.5, no_dropout, True)
    torch.testing.assert_close(compiled(q, k, v, bias), reference, atol=1e-5, rtol=0)


def test_shipped_table_is_well_formed():
    allowed = {"kernel": {"torch", "triton"}, "prop_attn": set(attention.PROP_ATTN_IMPLS),
               "prop_attn_compiled": set(attention.PROP_ATTN_IMPLS)}
    for (device_class, dtype), entry in device_table._entries().items():
        assert dtype in ("fp32", "bf16", "fp16") and device_class
        assert entry.get("measured"), "every entry names the run it comes from"
        for field in device_table.FIELDS:
            assert entry.get(field) is None or entry[field] in allowed[field]
