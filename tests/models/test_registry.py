"""timm names: tags on existing architectures, short names, listing, errors, idempotent import."""
import importlib
import warnings

import pytest
import timm
import torch

import timm_tokcomp
from timm_tokcomp.families import UNSERVED_MODULES, family_of
from timm_tokcomp.models import timm_names as registry
from timm_tokcomp.methods import METHODS
from timm_tokcomp.families.vit import ReducingVisionTransformer, ReducingVisionTransformerDistilled


@pytest.mark.parametrize(
    "name, method, r",
    [
        ("deit_base_patch16_224.tome_r16", "tome", 16),
        ("deit_small.tome_r8", "tome", 8),
        ("deit_tiny_patch16_224.fb_in1k.tome_r8", "tome", 8),
        ("deit_base.evit_r8", "evit", 8),
        ("deit_tiny_distilled_patch16_224.tome_r4", "tome", 4),
        ("vit_small_patch16_224.augreg_in21k_ft_in1k.evit_r3", "evit", 3),
    ],
)
def test_tagged_names_create_reduced_models(name, method, r):
    with torch.device("meta"):
        model = timm.create_model(name)
    reducer = timm_tokcomp.get_reducer(model)
    assert (reducer.name, reducer.r) == (method, r)


def test_short_name_is_the_patch16_224_model():
    a, b = timm.create_model("deit_tiny"), timm.create_model("deit_tiny_patch16_224")
    assert [(k, v.shape) for k, v in a.state_dict().items()] == [(k, v.shape) for k, v in b.state_dict().items()]
    assert not timm_tokcomp.is_reduced(a)


def test_plain_names_are_untouched():
    model = timm.create_model("deit_tiny_patch16_224.fb_in1k")
    assert not timm_tokcomp.is_reduced(model)


def test_tagged_names_are_listed_as_pretrained():
    listed = set(timm.list_models("deit*", pretrained=True))
    for name in ("deit_base_patch16_224.fb_in1k.tome_r16", "deit_small.fb_in1k.tome_r8",
                 "deit_base.fb_in1k.evit_r8", "deit_tiny_patch16_224.fb_in1k"):
        assert name in listed
    assert "deit_tiny" in timm.list_models("deit_tiny")


@pytest.mark.parametrize("name", ["deit_base.tome_x", "deit_base.fb_in1k.bogus", "deit_base.nope", "deit_base.foo_r8"])
def test_unknown_tag_lists_valid_forms(name):
    with pytest.raises(ValueError, match=r"valid forms: .*tome_r<k>.*evit_r<k>.*pretrained tags of .*fb_in1k") as e:
        timm.create_model(name)
    # ATM's 59 operating points as one item: the message stays readable (it was about 1,200 characters)
    assert "atm_g<GFLOPs>" in str(e.value) and "atm_g105" not in str(e.value) and len(str(e.value)) < 900


def test_reimport_is_harmless():
    before = (len(timm.list_models(pretrained=True)), timm.models.model_entrypoint("deit_small_patch16_224"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(registry)
        registry.register_all()
        importlib.reload(timm_tokcomp)
    after = (len(timm.list_models(pretrained=True)), timm.models.model_entrypoint("deit_small_patch16_224"))
    assert before == after
    assert timm_tokcomp.get_reducer(timm.create_model("deit_tiny.tome_r2")).r == 2


def test_every_listed_architecture_is_supported():
    """Build each architecture that takes method tags on the meta device and check the engine accepts it."""
    refused, no_class_token = [], set()
    for arch in registry.supported_archs():
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = timm.create_model(arch)
        if not family_of(type(model)).has_class_token(model):
            no_class_token.add(arch)
        grid_only = family_of(type(model)).method_refusal(METHODS["tome"]) is not None  # SAM: grid-keeping methods
        try:
            timm_tokcomp.apply(model, "cubist" if grid_only else "tome", **({"r_rows": 1} if grid_only else {"r": 1}))
        except TypeError as e:
            refused.append((arch, str(e)))
    assert refused == []
    # read from the arguments timm builds each with, nothing built: the same answer as the built model's
    assert no_class_token == {a for a in registry.supported_archs() if not registry.arch_facts(a).class_token}
    assert len(no_class_token) == 93  # timm 1.0.31: the gap, SigLIP, AIMv2, PE, 8 NaFlexVit and 4 SAM models
    # list_models(pretrained=True) advertises no name that cannot be built: no EViT without a class token
    listed = timm.list_models(pretrained=True)
    assert not [n for n in listed if ".evit" in n and n.split(".")[0] in no_class_token]
    assert any(".evit_r8" in n for n in listed)
    assert any(n.endswith(".tome_r8") and n.split(".")[0] in no_class_token for n in listed)  # ToMe still listed
    assert type(timm.create_model("deit_tiny_distilled_patch16_224.tome_r1")) is ReducingVisionTransformerDistilled
    assert type(timm.create_model("deit_tiny.tome_r1")) is ReducingVisionTransformer


def test_refused_architectures_are_really_refused():
    """Each architecture the registry refuses from its build arguments (parallel, post-norm and differential blocks
    in timm 1.0.31) is refused by the engine once built, with the same class named."""
    by_module = {arch for module in UNSERVED_MODULES for arch in timm.list_models(module=module)}  # test_patch
    refused = {arch: why for arch, why in registry._unserved_archs().items() if arch not in by_module}
    assert len(refused) == 10
    for arch, why in sorted(refused.items()):
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = timm.create_model(arch)
        with pytest.raises(TypeError) as refusal:
            timm_tokcomp.apply(model, "tome", r=1)
        assert why.split(",")[0].split()[-1] in str(refusal.value), (arch, why)  # the block / attention class


@pytest.mark.parametrize("name", ["deit_tiny_patch16_224.tome_r8", "deit_tiny.atm", "deit_small.atm",
                                  "deit_tiny_patch16_224.fb_in1k.tome_r13", "vit_small_patch16_224.evit_r8",
                                  "deit_tiny_distilled_patch16_224.tome_r8", "vit_small_patch16_224.dense_tome_r8"])
def test_timm_lookups_by_name_agree_with_create_model(name):
    """Config by name and pretrained status for every accepted form, any k (issue: 'Invalid pretrained tag')."""
    base = name.rpartition(".")[0]
    assert timm.get_pretrained_cfg_value(name, "input_size") == timm.get_pretrained_cfg_value(base, "input_size")
    assert timm.get_pretrained_cfg(name).hf_hub_id == timm.get_pretrained_cfg(base).hf_hub_id
    assert timm.is_model_pretrained(name) == timm.is_model_pretrained(base) is True
    with torch.device("meta"):
        model = timm.create_model(name)
    assert model.pretrained_cfg["input_size"] == timm.get_pretrained_cfg_value(name, "input_size")


def test_names_that_are_not_ours_resolve_as_before():
    with pytest.raises(RuntimeError, match="Invalid pretrained tag"):
        timm.get_pretrained_cfg("deit_tiny_patch16_224.bogus")
    with pytest.raises(RuntimeError, match="Invalid pretrained tag"):
        timm.get_pretrained_cfg("resnet18.tome_r8")  # not a supported architecture
    assert not timm.is_model_pretrained("resnet18.tome_r8")
    assert "deit_tiny_patch16_224.fb_in1k.tome_r13" not in timm.list_models("deit_tiny*", pretrained=True)


def test_a_method_tag_in_the_name_is_kept_or_refused_with_pretrained_cfg():
    """timm drops a name's tag when pretrained_cfg is given: the method rides on a pretrained_cfg tag name, and any
    other pretrained_cfg is refused instead of silently building a plain model."""
    with torch.device("meta"):
        model = timm.create_model("deit_tiny_patch16_224.tome_r8", pretrained_cfg="fb_in1k")
        assert timm_tokcomp.get_reducer(model).r == 8
        assert timm_tokcomp.get_reducer(timm.create_model("deit_tiny.evit_r4", pretrained_cfg="fb_in1k")).r == 4
        with pytest.raises(ValueError, match="carries method tag 'tome_r8'.*timm_tokcomp.apply"):
            timm.create_model("deit_tiny_patch16_224.tome_r8", pretrained_cfg={"input_size": (3, 224, 224)})
        assert not timm_tokcomp.is_reduced(timm.create_model("deit_tiny_patch16_224", pretrained_cfg="fb_in1k"))


@pytest.mark.parametrize("name, family", [
    ("vit_base_patch16_siglip_224.v2_webli.tome_r16", "ReducingVisionTransformer"),
    ("vit_small_patch16_dinov3.lvd1689m.tome_r16", "ReducingEva"),
    ("eva02_base_patch14_224.mim_in22k.tome_r8", "ReducingEva"),
    ("vit_pe_core_base_patch16_224.fb.evit_r8", "ReducingEva"),
    ("vit_base_patch16_rope_mixed_224.naver_in1k.tome_r8", "ReducingEva"),
    ("naflexvit_base_patch16_siglip.v2_webli.tome_r16", "ReducingNaFlexVit"),
    ("naflexvit_base_patch16_radio_v3.c_radio.evit_r8", "ReducingNaFlexVit"),
])
def test_newer_families_take_method_tags_and_are_listed(name, family):
    with torch.device("meta"):
        assert type(timm.create_model(name)).__name__ == family
    arch = name.split(".")[0]
    assert f"{name.rpartition('.')[0]}.tome_r16" in timm.list_models(f"{arch}*", pretrained=True)


@pytest.mark.parametrize("name, why", [("gemma4_vit_167m.tome_r8", "Gemma 4's vision encoder"),
                                       ("vit_base_patch16_xp_224.evit_r8", "ParallelScalingBlock")])
def test_a_method_tag_on_an_unserved_class_says_which_classes_are_served(name, why):
    with pytest.raises(TypeError, match=rf"does not take method tags .*{why}.*VisionTransformer .*Eva"):
        timm.create_model(name)


def test_an_unreachable_hub_under_a_tagged_name_is_one_error_without_huggingface_hubs_advice(monkeypatch):
    """The error stands alone: huggingface_hub's own message under it would tell the user to unset HF_HUB_OFFLINE,
    which they never set (the package sets it for an unreachable Hub)."""
    from huggingface_hub.errors import OfflineModeIsEnabled
    from timm.models import _builder

    def offline(*args, **kwargs):
        raise OfflineModeIsEnabled("Cannot reach the Hub: offline mode is enabled. To disable it, please unset the "
                                   "`HF_HUB_OFFLINE` environment variable.")

    monkeypatch.setattr(_builder, "load_pretrained", offline)
    with pytest.raises(OSError, match="not in the local cache") as refused:
        timm.create_model("deit_tiny_patch16_224.tome_r8", pretrained=True)
    assert refused.value.__cause__ is None and refused.value.__suppress_context__
    assert "unset" not in str(refused.value)


@pytest.mark.parametrize("name", ["deit_tiny_patch16_224.tome_r8", "deit_tiny_patch16_224.fb_in1k.tome_r8"])
def test_a_tagged_name_parses_its_method_tag_once(name, monkeypatch):
    """create_model of a tagged name reads its method tag once and carries the result to apply."""
    from timm_tokcomp.methods.tome import ToMe

    real, seen = ToMe.parse_tag.__func__, []

    def counting(cls, tag):
        seen.append(tag)
        return real(cls, tag)

    monkeypatch.setattr(ToMe, "parse_tag", classmethod(counting))
    model = timm.create_model(name)
    assert seen.count("tome_r8") == 1 and timm_tokcomp.get_reducer(model).params["r"] == 8


def test_build_args_reads_what_an_entrypoint_builds_without_building_it():
    """Family.build_args stops at the model's constructor: the class and its arguments (defaults filled), nothing
    built, and the constructor works as before afterwards, in this thread and in others meanwhile."""
    import threading

    from timm.models.vision_transformer import VisionTransformer

    from timm_tokcomp.families import VIT

    entry = timm.models._registry._model_entrypoints["deit_tiny_patch16_224"]
    args = VIT.build_args(getattr(entry, "tokcomp_original", entry))
    assert args.model_class is VisionTransformer
    assert (args.arg("embed_dim"), args.arg("depth"), args.arg("class_token")) == (192, 12, True)
    assert VIT.builds_class_token(args)
    built = []
    other = threading.Thread(target=lambda: built.append(timm.create_model("test_vit", pretrained=False)))
    other.start()
    for _ in range(20):  # another thread builds while this one reads
        VIT.build_args(lambda: timm.create_model("test_vit", pretrained=False))
    other.join()
    assert type(built[0]) is VisionTransformer
    assert type(timm.create_model("test_vit")) is VisionTransformer

    def failing():
        raise RuntimeError("needs an argument")

    assert VIT.build_args(failing) is None  # nothing to read: the architecture is not listed
    assert type(timm.create_model("test_vit")) is VisionTransformer


@pytest.mark.parametrize("name, kwargs", [("deit_tiny_patch16_224.tome_r8", {}), ("deit_tiny.tome_r8", {}),
                                          ("deit_tiny_patch16_224.tome_r8", {"pretrained_cfg": "fb_in1k"}),
                                          ("deit_tiny_patch16_224.fb_in1k.tome_r8", {"pretrained_cfg": "fb_in1k"})])
def test_a_names_method_tag_is_parsed_once(name, kwargs, monkeypatch):
    """The door that reads the name parses its method tag; what comes after reuses the parse (a pretrained_cfg the
    user gives is read once, for a method tag of its own)."""
    from timm_tokcomp.models import timm_names as registry

    parsed = []
    real = registry.match_method_tag
    monkeypatch.setattr(registry, "match_method_tag", lambda tag: parsed.append(tag) or real(tag))
    model = timm.create_model(name, **kwargs)
    assert timm_tokcomp.get_reducer(model).params["r"] == 8
    assert sorted(parsed) == sorted(["tome_r8", *kwargs.values()])


def test_a_failed_resolution_leaves_no_method_tag_for_the_next_call():
    """A name whose resolution fails after its method tag was read must not hand that tag to the next model of the
    architecture built with a pretrained_cfg: it stays plain."""
    def failing(model_name, pretrained_cfg, *args, **kwargs):
        raise RuntimeError("resolution failed")

    with pytest.raises(RuntimeError, match="resolution failed"):
        registry._keep_method_tag(failing)("deit_tiny_patch16_224.tome_r8", "fb_in1k", {})
    model = timm.models.model_entrypoint("deit_tiny_patch16_224")(pretrained_cfg="fb_in1k")  # the wrapped one
    assert not timm_tokcomp.is_reduced(model)


# a timm whose private registry moved or changed: (what the script does to timm before importing timm_tokcomp,
# what the warning names)
_TIMM_CHANGES = {
    "renamed module": ("import timm.models, sys; del timm.models._registry; sys.modules['timm.models._registry'] = None",
                       "import of timm.models._registry"),
    "renamed table": ("import timm.models._registry as r; r._model_entrypoints_renamed = r.__dict__.pop("
                      "'_model_entrypoints')", "AttributeError: timm.models._registry has no _model_entrypoints"),
    "table of another kind": ("import timm.models._registry as r; r._model_has_pretrained = sorted("
                              "r._model_has_pretrained)", "TypeError: timm.models._registry._model_has_pretrained is "
                                                          "a list, not a set"),
    "no name door": ("import timm.models._factory as f; f.__dict__.pop('_resolve_model_source', None); "
                     "f.__dict__.pop('split_model_name_tag', None)", "has neither _resolve_model_source nor"),
}


def test_an_error_of_timm_tokcomps_own_in_registering_is_raised_not_warned(monkeypatch):
    """Only a timm that differs costs the names with a warning; an error of the adapter itself is raised."""
    from timm_tokcomp.models import timm_names

    def broken():
        raise KeyError("a bug of ours")

    monkeypatch.setattr(timm_names, "_register_all", broken)
    with pytest.raises(KeyError, match="a bug of ours"):
        timm_names.register_all()
    assert timm_names._registry_differs() is None  # this timm is as the adapter reads it


@pytest.mark.parametrize("change", sorted(_TIMM_CHANGES))
def test_a_timm_whose_private_registry_changed_costs_the_names_only(change):
    """Every touch of timm's private registry and factory is in models/timm_names.py; where a timm release renames
    one, `import timm_tokcomp` warns naming the timm version, and apply, set_params and remove still work."""
    import subprocess
    import sys

    before, error = _TIMM_CHANGES[change]
    script = f"""{before}
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import timm_tokcomp
said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
assert len(said) == 1 and "timm " in said[0] and "{error}" in said[0] and "not registered" in said[0], said
import torch
from timm.models.vision_transformer import VisionTransformer
model = VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=5).eval()
x = torch.randn(2, 3, 32, 32)
with torch.no_grad():
    plain = model(x)
    timm_tokcomp.apply(model, "tome", r=2)
    timm_tokcomp.set_params(model, r=3)
    model(x)
    assert timm_tokcomp.last_stats(model).tokens_per_block == [17, 14]
    timm_tokcomp.remove(model)
    assert torch.equal(model(x), plain)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
