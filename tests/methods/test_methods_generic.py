"""Every registered token-reducing method through the same checks: forward at batch 1, backward to every
parameter, 'reduce nothing' equal to plain timm bit for bit, prefix tokens untouched, every patch held by at
most one token (exactly one for merging methods; total weight 1 for soft merging) with sizes counting them, deterministic output, and
remove() restoring the plain model."""
import json

import pytest
import torch

import timm_tokcomp
from timm.models.vision_transformer import VisionTransformer
from timm_tokcomp.methods import METHODS
from conftest import SMALL, VARIANTS, make_model, reducing_setting, thresholds

N_PATCH = (SMALL["img_size"] // SMALL["patch_size"]) ** 2  # 64
NOTHING = {"atm": dict(alpha=1.0, beta=0.0, theta_min=1.0, prefix_only_last_block=False)}  # no merge, full last MLP
NOTHING["cubist"] = dict(r_rows=0, r_cols=0)
NOTHING["dymu"] = dict(thresholds=[None] * SMALL["depth"])
NOTHING["diffrate"] = dict(schedule={"prune": [N_PATCH] * SMALL["depth"], "merge": [N_PATCH] * SMALL["depth"]})
NOTHING["visionzip"] = dict(dominant=N_PATCH - 1, contextual=1)  # every patch token kept
NOTHING["ltmp"] = lambda: dict(threshold_params=thresholds(SMALL["depth"], merge=1.0))  # no cosine exceeds 1; no importance is < 0
REDUCING = {"atm": dict(alpha=0.5, beta=0.0, theta_min=0.5, prefix_only_last_block=False),
            "ltmp": lambda: dict(threshold_params=thresholds(SMALL["depth"], merge=0.5, prune=2.0)),
            "dymu": dict(thresholds=[0.0] * SMALL["depth"]),
            "visionzip": dict(dominant=6, contextual=2, block=1)}
TOKEN_METHODS = sorted(name for name, cls in METHODS.items() if not cls.spec.dense)


def _fresh(params):
    return params() if callable(params) else params


def _reducing_params(method):
    return _fresh(REDUCING.get(method, reducing_setting(METHODS[method], 8, {"keep_rate": 0.6, "stages": (2, 3)})))


def _variants(method):
    return [v for v in sorted(VARIANTS) if not (METHODS[method].spec.needs_class_token and v == "avgpool_noclass")]


ALWAYS_REDUCES = {"fpet"}  # merges half the patches at its block: it has no setting that merges nothing


@pytest.mark.parametrize("method, variant", [(m, v) for m in TOKEN_METHODS if m not in ALWAYS_REDUCES
                                             for v in _variants(m)])
def test_reducing_nothing_is_plain_timm_bit_for_bit(method, variant, images):
    plain = make_model(variant)
    model = timm_tokcomp.apply(make_model(variant), method, **_fresh(NOTHING.get(method, {"r": 0})))
    with torch.no_grad():
        assert torch.equal(model(images), plain(images))
    if "keep_rate" in METHODS[method].param_names():
        model = timm_tokcomp.apply(make_model(variant), method, keep_rate=1.0, stages=(2, 4))
        with torch.no_grad():
            assert torch.equal(model(images), plain(images))


@pytest.mark.parametrize("method", TOKEN_METHODS)
def test_method_contract(method, images):
    model = timm_tokcomp.apply(make_model("registers"), method, trace_source=True, **_reducing_params(method))
    p = model.num_prefix_tokens
    with torch.no_grad():
        out = model(images[:1])
        assert out.shape == (1, SMALL["num_classes"]) and torch.isfinite(out).all()
        first = model(images)
        assert torch.equal(first, model(images))  # deterministic
    stats = timm_tokcomp.last_stats(model)
    assert stats.tokens_out < N_PATCH + p
    held = stats.source.sum(1)  # (B, N0): tokens holding each original token
    assert torch.equal(stats.source[:, :p], torch.eye(N_PATCH + p)[:p].expand(len(images), -1, -1))
    assert torch.equal(stats.size[:, :p], torch.ones(len(images), p, 1))
    holds = METHODS[method].spec.holds_patches
    if holds == "soft":
        torch.testing.assert_close(stats.size[..., 0], stats.source.sum(-1))
        torch.testing.assert_close(held, torch.ones_like(held))
        assert stats.source.min() >= 0
    elif holds == "dropped":
        assert torch.equal(stats.size[..., 0], stats.source.sum(-1))
        assert held.max() == 1 and held.min() == 0
    elif holds == "similarity":
        assert held.max() == 1 and held.min() == 0
        assert (stats.size[..., 0] >= 1).all() and (stats.size[..., 0] <= stats.source.sum(-1) + 1e-5).all()
    else:
        assert torch.equal(stats.size[..., 0], stats.source.sum(-1))
        assert torch.equal(held, torch.ones_like(held))

    model.train()
    model(images).logsumexp(-1).sum().backward()
    missing = [n for n, prm in model.named_parameters() if prm.grad is None]
    assert not missing, f"no gradient reaches {missing}"

    timm_tokcomp.remove(model)
    plain = make_model("registers")
    plain.load_state_dict(model.state_dict())
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(images), plain(images))


def test_numpy_numbers_are_accepted_as_the_python_numbers_they_equal():
    """Every numeric parameter takes numpy's integer and float types (r from np.arange, a rate from an array) and
    keeps them as Python numbers, so presets and cards serialise them."""
    import numpy as np

    model = VisionTransformer(img_size=32, patch_size=4, embed_dim=48, depth=4, num_heads=3, num_classes=10).eval()
    for method, params, key, want in [
        ("tome", {"r": np.int64(2)}, "r", 2), ("tome", {"r": [np.int32(1)] * 4}, "r", [1] * 4),
        ("tome", {"r": (np.int16(2), np.float32(0.5))}, "r", (2, 0.5)),
        ("tome", {"flops_ratio": np.float32(1.5)}, "flops_ratio", 1.5),
        ("topk", {"keep_rate": np.float64(0.75), "stages": (2, 3)}, "keep_rate", 0.75),
        ("dense_tome", {"r": np.uint8(1)}, "r", 1), ("atm", {"split_layer": np.int64(1)}, "split_layer", 1),
    ]:
        timm_tokcomp.apply(model, method, **params)
        got = timm_tokcomp.get_reducer(model).params[key]
        assert got == want and type(got) is type(want), (method, params, got)
        json.dumps(timm_tokcomp.get_reducer(model).params, default=list)
    with pytest.raises(ValueError, match="r must be an int"):
        timm_tokcomp.apply(model, "tome", r=np.float64(2.0))


def test_numpy_numbers_are_accepted_by_every_numeric_argument_check():
    """The same rule (schedules.is_int / is_real) at the other doors that take numbers from Python callers."""
    import numpy as np

    from timm_tokcomp.deployment.modes import check_batches
    from timm_tokcomp.tocom import Compensator, attach, set_compression
    from timm_tokcomp.tocom.compensator import check_scale
    from timm_tokcomp.commands.tune.run import _check_args

    check_batches([np.int64(1), np.int32(8)])
    _check_args([np.int64(2)], np.float32(1.0), np.float64(1.1), np.int64(200), np.int64(100), np.int64(5),
                ["eager"], "cpu")
    assert check_scale(np.float32(0.5)) == 0.5
    model = VisionTransformer(img_size=32, patch_size=4, embed_dim=48, depth=4, num_heads=3, num_classes=10).eval()
    compensator = Compensator.init(4, 4, 48, 48, 2, 1.0)
    attach(model, compensator, source_r=np.int64(0))
    set_compression(model, np.int16(2))
    assert timm_tokcomp.get_reducer(model).r == 2
    with pytest.raises(ValueError, match="--batches must be a non-empty list of batch sizes >= 1"):
        check_batches([np.float64(2.0)])


def test_a_new_method_declares_only_its_own_parameters():
    """methods.params: a subclass lists its one new parameter between the shared groups and gets the constructor
    (positional or keyword, checked), the signature, param_names and params from the base class."""
    import inspect

    from timm_tokcomp.methods.base import ScheduledReducer
    from timm_tokcomp.methods.params import COMMON, SCHEDULE, Param
    from timm_tokcomp.methods.topk import TopK

    def check_width(value):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"width must be an integer >= 1, got {value!r}")
        return value

    class Wide(TopK):
        spec = TopK.spec.but(name="wide", params=(*SCHEDULE, Param("width", 2, check_width), *COMMON))

    assert issubclass(Wide, ScheduledReducer)
    wide = Wide(4, width=3)
    assert (wide.r, wide.width, wide.keep_rate, wide.prop_attn) == (4, 3, None, None)
    assert Wide.param_names() == ("r", "flops_ratio", "keep_rate", "stages", "width", "prop_attn", "trace_source",
                                  "prefix_only_last_block", "rope_merge")
    assert str(inspect.signature(Wide)).startswith("(r=0, flops_ratio=None, keep_rate=None, stages=(4, 7, 10), width=2")
    assert wide.params["width"] == 3 and "width=3" in repr(wide)
    with pytest.raises(ValueError, match="width must be an integer >= 1, got 0"):
        Wide(width=0)
    with pytest.raises(ValueError, match="give one of r, flops_ratio, keep_rate"):  # the base class's joint check
        Wide(r=2, keep_rate=0.5)
    with pytest.raises(TypeError, match=r"unknown parameter\(s\) \['depth'\] for method 'wide'; valid: \['r'"):
        Wide(depth=3)
    with pytest.raises(TypeError, match="missing a required argument: 'beta'"):
        METHODS["atm"](0.9)
    with pytest.raises(TypeError, match=r"Old sets PARAMS, name on the class: declare them in its spec"):
        class Old(TopK):  # a method written before specs: its traits would be read nowhere
            name = "old"
            PARAMS = (*SCHEDULE, *COMMON)


PROP_IMPLS = ["fold", "fold_qkv", "flex"]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("method, impl", [(m, i) for m in TOKEN_METHODS for i in PROP_IMPLS])
def test_every_prop_attn_implementation_gives_the_float_mask_result(method, impl, images):
    """Every method reads the same q, k, v and tokens whichever implementation adds log(size) (one model with a
    class token and registers, proportional attention on)."""
    results = {}
    for name in ("mask", impl):
        model = timm_tokcomp.apply(make_model("registers"), method, prop_attn=name, **_reducing_params(method))
        with torch.no_grad():
            results[name] = model(images)
    torch.testing.assert_close(results[impl], results["mask"], atol=1e-5, rtol=0)


def test_a_method_registers_itself_and_a_second_class_of_one_name_is_refused():
    from timm_tokcomp.methods import METHODS, register_method
    from timm_tokcomp.methods.tome import ToMe
    from timm_tokcomp.methods.topk import TopK

    class Impostor(TopK):
        spec = TopK.spec.but(name="tome")

    assert METHODS["tome"] is ToMe and register_method(ToMe) is ToMe  # registering again is a no-op
    with pytest.raises(ValueError, match="two methods are named 'tome': ToMe and .*Impostor"):
        register_method(Impostor)
    assert METHODS["tome"] is ToMe


@pytest.mark.parametrize("method", TOKEN_METHODS)
def test_an_empty_batch_and_bf16_autocast_run(method, images):
    """Batch 0 gives (0, classes); under bf16 autocast the output is finite and, for a method whose counts do not
    come from the data, the token counts are fp32's."""
    model = timm_tokcomp.apply(make_model("cls"), method, **_reducing_params(method))
    with torch.no_grad():
        assert model(images[:0]).shape == (0, SMALL["num_classes"])
        model(images)
        counts = timm_tokcomp.last_stats(model).tokens_per_block
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(images)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    if not METHODS[method].spec.data_dependent:
        assert timm_tokcomp.last_stats(model).tokens_per_block == counts


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_methods_spec_says_what_its_classes_do(method):
    """The spec (what a method is) and the class (what it does) agree: the grid-reading hook with reads_grid, the
    learned-parameter protocol with learned_class, the tag forms that read the method's own name."""
    from timm_tokcomp.methods.base import GridSettings, LearnedParams
    from timm_tokcomp.methods.spec import MethodSpec

    cls = METHODS[method]
    spec = cls.spec
    assert isinstance(spec, MethodSpec) and spec.name == cls.name == method
    assert issubclass(cls, GridSettings) == spec.reads_grid
    assert issubclass(cls, LearnedParams) == (spec.learned_class is not None)
    assert cls.param_names() == tuple(p.name for p in spec.params)
    for form in spec.tag_forms():  # a form with a number in it reads that number's tag as this method's
        tag = form.replace("<k>", "2").replace("<pct>", "50")
        assert "<" in tag or cls.parse_tag(tag) is not None, (form, tag)
