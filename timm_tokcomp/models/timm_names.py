"""timm name hooks: `<arch>[.<pretrained tag>].<method>_r<k>` on the supported ViT / DeiT entry
points, and the short architectures deit_tiny / deit_small / deit_base.

The method tag is parsed by the wrapped entry point, which builds the plain model through timm (so
`pretrained=True` loads the usual weights) and then applies the method. The listed pretrained cfgs of
the tagged names are unchanged copies of the base cfgs: no compression parameter lives in them.
"""
import contextlib
import contextvars
import functools
import warnings
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import timm

try:  # timm's private registry and factory: every touch of them is in this module
    from timm.models import _factory, _registry as treg
    from timm.models._features import FeatureGetterNet
    from timm.models._pretrained import DefaultCfg
except ImportError as e:  # a timm that moved them: the registered names are lost, never apply or the import
    _factory = treg = FeatureGetterNet = DefaultCfg = None
    _PRIVATE_MISSING: Optional[str] = f"{type(e).__name__}: {e}"
else:
    _PRIVATE_MISSING = None

from ..families import FAMILIES, UNSERVED_MODULES, Family, served_classes
from ..methods import TAG_SUMMARY, listed_tags, match_method_tag, method_class, parse_method_tag, refuse_tagless_method
from ..files.hub import hub_access, pretrained_unreachable
from ..runtime.state import state_of

# timm drops the name's tag when pretrained_cfg is also given; the method tag the name carried is remembered here,
# (name, parsed MethodTag), by the door that read it (timm's name split or resolution), for the entrypoint that
# create_model calls next
_NAME_METHOD_TAG: contextvars.ContextVar[Optional[Tuple[str, "MethodTag"]]] = contextvars.ContextVar(
    "tokcomp_name_method_tag", default=None)

SHORT_NAMES = {
    "deit_tiny": "deit_tiny_patch16_224",
    "deit_small": "deit_small_patch16_224",
    "deit_base": "deit_base_patch16_224",
}


def architecture_of(name: str) -> str:
    """The timm architecture a model name stands for: its pretrained tag and method tag dropped, a short name
    resolved ('deit_tiny.fb_in1k' -> 'deit_tiny_patch16_224')."""
    arch = name.split(".")[0]
    return SHORT_NAMES.get(arch, arch)



class ArchFacts(NamedTuple):
    """What the registry needs of an architecture, read from the arguments timm builds it with (Family.build_args,
    nothing built): why its family refuses it (None: served), and whether it has a class token (the methods that
    rank by class attention, such as EViT, are not listed without one), and its family (which may refuse a method
    on all its models: Family.method_refusal)."""

    refusal: Optional[str]
    class_token: bool
    family: Family


_FACTS: Dict[str, Optional[ArchFacts]] = {}


def arch_facts(arch: str) -> Optional[ArchFacts]:
    """The facts of a registered architecture of a served family's modules (or a short name's); None for any
    other name."""
    arch = SHORT_NAMES.get(arch, arch)
    if arch not in _FACTS:
        module = treg._model_to_module.get(arch)
        family = next((f for f in FAMILIES if module in f.timm_modules), None)
        fn = treg._model_entrypoints.get(arch)
        args = None if family is None or fn is None else family.build_args(getattr(fn, "tokcomp_original", fn))
        _FACTS[arch] = None if args is None else ArchFacts(family.arch_refusal(args), family.builds_class_token(args),
                                                           family)
    return _FACTS[arch]


_LISTED = set()  # the '<arch>[.<pretrained tag>].<method tag>' names _list_method_names added to timm's lists


def _pretrained_tags(arch: str) -> Tuple[str, ...]:
    """The plain pretrained tags registered for an architecture ('' for the untagged default): timm's, not the
    method-tagged names this package lists beside them."""
    return tuple(treg.split_model_name_tag(name)[1] for name in treg._model_with_tags.get(arch, ())
                 if name not in _LISTED)


class MethodTag(NamedTuple):
    """A name's method tag, parsed once: 'tome_r8' -> MethodTag('tome_r8', 'tome', {'r': 8})."""

    tag: str
    method: str
    params: Dict[str, Any]


def method_tag_of(text: str) -> Optional[MethodTag]:
    """The method tag ending a name or a tag, parsed ('fb_in1k.tome_r8' -> MethodTag('tome_r8', 'tome', {'r': 8})),
    or None where it ends in none: the registry's one parse of a method tag."""
    last = text.rpartition(".")[2]
    found = match_method_tag(last)
    return None if found is None else MethodTag(last, *found)


def split_method_tag(arch: str, tag: str, parsed: Optional[MethodTag] = None) -> Tuple[str, Optional[MethodTag]]:
    """'fb_in1k.tome_r8' -> ('fb_in1k', MethodTag('tome_r8', 'tome', {'r': 8})); 'tome_r8' -> ('', MethodTag(...));
    'fb_in1k' -> ('fb_in1k', None).

    parsed: the method tag a door already parsed from the model's name (not parsed again where tag ends in it).
    Raises ValueError listing the valid forms for a tag that is neither a pretrained tag of `arch`
    nor ends in a method tag."""
    base, _, last = tag.rpartition(".")
    method_tag = parsed if parsed is not None and parsed.tag == last else method_tag_of(last)
    if method_tag is None:
        if not base and last in _pretrained_tags(arch):
            return last, None
        base = tag
    known = _pretrained_tags(arch)
    if base and base not in known:
        refuse_tagless_method(last, f"unknown tag {tag!r} for {arch}")
        shown = ", ".join(t for t in known if t) or "(none)"
        raise ValueError(
            f"unknown tag {tag!r} for {arch}; valid forms: {arch}, {arch}.<pretrained tag>, "
            f"{arch}[.<pretrained tag>].<method tag> with method tag one of {TAG_SUMMARY}; "
            f"pretrained tags of {arch}: {shown}"
        )
    return base, method_tag


def _wrap_entrypoint(arch: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def entrypoint(pretrained: bool = False, pretrained_cfg: Any = None, **kwargs: Any):
        name_tag = _NAME_METHOD_TAG.get()
        _NAME_METHOD_TAG.set(None)
        parsed = name_tag[1] if name_tag and name_tag[0] == arch else None  # the name's, parsed at timm's door
        if parsed is not None and pretrained_cfg is not None:
            pretrained_cfg = _cfg_keeping_method(f"{arch}.{parsed.tag}", parsed, pretrained_cfg)
        method_tag = None
        if isinstance(pretrained_cfg, str):
            base, method_tag = split_method_tag(arch, pretrained_cfg, parsed)
            pretrained_cfg = base or None
        if method_tag and kwargs.get("features_only") and kwargs.get("feature_cls", "getter") != "getter":
            raise ValueError(f"features_only with a method tag ({method_tag.tag}) needs feature_cls='getter' (the "
                             f"default): the reduced blocks run only inside the model's forward_intermediates, "
                             f"not one by one as the hook-based feature classes call them")
        try:
            with hub_access() if pretrained else contextlib.nullcontext():  # an unreachable Hub fails in seconds
                model = fn(pretrained=pretrained, pretrained_cfg=pretrained_cfg, **kwargs)
        except OSError as e:  # huggingface_hub's download errors
            error = pretrained_unreachable(e, arch)
            if error is e:
                raise
            # alone: huggingface_hub's own message would tell the user to unset HF_HUB_OFFLINE, which hub_access set
            raise error from None
        if method_tag:
            from ..core import apply

            if isinstance(model, FeatureGetterNet):
                # timm pruned the blocks after the last out_index; the schedule stays the full model's
                state_of(model.model, create=True).depth = len(model.model.feature_info)
                apply(model.model, method_tag.method, **method_tag.params)
            else:
                apply(model, method_tag.method, **method_tag.params)
        return model

    entrypoint.tokcomp_original = fn
    return entrypoint


def _refusing_entrypoint(arch: str, why: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """An architecture timm_tokcomp does not serve: a method tag on its name says why, instead of timm's
    "Invalid pretrained tag"; every other call is timm's."""
    @functools.wraps(fn)
    def entrypoint(pretrained: bool = False, pretrained_cfg: Any = None, **kwargs: Any):
        name_tag = _NAME_METHOD_TAG.get()
        _NAME_METHOD_TAG.set(None)
        method_tag = name_tag[1] if name_tag and name_tag[0] == arch else None
        if isinstance(pretrained_cfg, str):
            method_tag = method_tag_of(pretrained_cfg) or method_tag
        if method_tag:
            raise TypeError(f"{arch} does not take method tags ({method_tag.tag!r}): it is built from {why}. "
                            f"timm_tokcomp reduces tokens in timm's {served_classes()}.")
        return fn(pretrained=pretrained, pretrained_cfg=pretrained_cfg, **kwargs)

    entrypoint.tokcomp_original = fn
    return entrypoint


def _cfg_keeping_method(model_name: str, method_tag: MethodTag, pretrained_cfg: Any) -> Any:
    """The pretrained_cfg to build `model_name` (which carries `method_tag`) with: a tag name gains the method tag;
    any other pretrained_cfg, which timm would use instead of the name's tag, is refused rather than silently
    building a plain model."""
    if not isinstance(pretrained_cfg, str):
        raise ValueError(f"{model_name!r} carries method tag {method_tag.tag!r}, which timm ignores when "
                         f"pretrained_cfg is given as a {type(pretrained_cfg).__name__}; build the model "
                         f"without the method tag and call timm_tokcomp.apply(model, ...)")
    if pretrained_cfg.rpartition(".")[2] == method_tag.tag or method_tag_of(pretrained_cfg):
        return pretrained_cfg  # it carries the name's method tag (or another one) already
    return f"{pretrained_cfg}.{method_tag.tag}"


def _keep_method_tag(resolve: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap timm's name resolution (timm >= 1.0.31), which drops the name's tag when pretrained_cfg is also given."""
    @functools.wraps(resolve)
    def resolve_keeping_method(model_name: Any, pretrained_cfg: Any, *args: Any, **kwargs: Any):
        remembered = None  # set on every call: a parse never outlives the call that made it
        if pretrained_cfg and isinstance(model_name, str):
            name, tag = treg.split_model_name_tag(model_name)
            method_tag = method_tag_of(tag)
            if method_tag:
                pretrained_cfg = _cfg_keeping_method(model_name, method_tag, pretrained_cfg)
                remembered = (SHORT_NAMES.get(name, name), method_tag)  # parsed: the entrypoint reuses it
        _NAME_METHOD_TAG.set(remembered)
        try:
            return resolve(model_name, pretrained_cfg, *args, **kwargs)
        except BaseException:
            _NAME_METHOD_TAG.set(None)  # no entrypoint follows: the next call must not read this name's tag
            raise

    resolve_keeping_method.tokcomp_original = resolve
    return resolve_keeping_method


def _remember_method_tag(split: Callable[..., Tuple[str, str]]) -> Callable[..., Tuple[str, str]]:
    """Wrap the name split that timm < 1.0.31's create_model calls before the entrypoint: remember a method tag."""
    @functools.wraps(split)
    def split_remembering_method(model_name: str, *args: Any, **kwargs: Any) -> Tuple[str, str]:
        name, tag = split(model_name, *args, **kwargs)
        method_tag = method_tag_of(tag)
        _NAME_METHOD_TAG.set((SHORT_NAMES.get(name, name), method_tag) if method_tag else None)
        return name, tag

    split_remembering_method.tokcomp_original = split
    return split_remembering_method


def _make_short_entrypoint(short: str, arch: str) -> Callable[..., Any]:
    def entrypoint(pretrained: bool = False, **kwargs: Any):
        return treg.model_entrypoint(arch)(pretrained=pretrained, **kwargs)

    entrypoint.__name__ = entrypoint.__qualname__ = short
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = f"{arch} under the short name {short} (takes the same method tags)."
    entrypoint.tokcomp_short = arch
    return entrypoint


# register_model reads `default_cfgs[name]` from the entry point's module: the short names reuse
# their architecture's resolved pretrained cfgs (hub ids already complete).
default_cfgs = {}


def _register_short_names() -> None:
    for short, arch in SHORT_NAMES.items():
        if getattr(treg._model_entrypoints.get(short), "tokcomp_short", None) == arch:
            continue
        tags = _pretrained_tags(arch)
        cfgs = {tag: treg._model_pretrained_cfgs[f"{arch}.{tag}" if tag else arch] for tag in tags}
        default_cfgs[short] = DefaultCfg(tags=deque(tags), cfgs=cfgs)
        treg.register_model(_make_short_entrypoint(short, arch))


def _list_method_names(arch: str) -> None:
    for tag in _pretrained_tags(arch):
        base_name = f"{arch}.{tag}" if tag else arch
        if base_name not in treg._model_has_pretrained:
            continue
        cfg = treg._model_pretrained_cfgs[base_name]
        facts = arch_facts(arch)
        for method_tag in listed_tags():
            method = method_class(parse_method_tag(method_tag)[0])
            if (not facts.class_token and method.spec.needs_class_token) or facts.family.method_refusal(method):
                continue  # a name that could not be built
            name = f"{base_name}.{method_tag}"
            if name in treg._model_pretrained_cfgs:
                continue
            treg._model_pretrained_cfgs[name] = replace(cfg)
            treg._model_has_pretrained.add(name)
            treg._model_with_tags[arch].append(name)
            _LISTED.add(name)


def base_name(name: Any) -> Optional[str]:
    """'<arch>[.<pretrained tag>].<method tag>' of a supported architecture -> '<arch>[.<pretrained tag>]',
    the name whose pretrained cfg it uses; None for any other name."""
    if not isinstance(name, str):
        return None
    base, _, last = name.rpartition(".")
    if not base or method_tag_of(last) is None or treg.split_model_name_tag(base)[0] not in _supported():
        return None
    return base


class _PretrainedCfgs(dict):
    """timm's table of pretrained cfgs by name, also answering for every method-tagged name of a supported
    architecture (any k, not only the listed tags) with its base name's cfg, so timm's lookups by name
    (get_pretrained_cfg, get_pretrained_cfg_value, ...) agree with create_model."""

    def __contains__(self, name: Any) -> bool:
        return dict.__contains__(self, name) or dict.__contains__(self, base_name(name) or "")

    def __missing__(self, name: Any):
        base = base_name(name)
        if base is None or not dict.__contains__(self, base):
            raise KeyError(name)
        return dict.__getitem__(self, base)

    def get(self, name: Any, default: Any = None):
        return self[name] if name in self else default


class _HasPretrained(set):
    """timm's set of names with pretrained weights; a method-tagged name has them when its base name has
    (is_model_pretrained). Iteration, and so list_models, still shows only the listed tags."""

    def __contains__(self, name: Any) -> bool:
        return set.__contains__(self, name) or set.__contains__(self, base_name(name) or "")


@functools.lru_cache(maxsize=1)
def _supported() -> frozenset:
    return frozenset(supported_archs())


def supported_archs() -> Tuple[str, ...]:
    """Architectures whose names take method tags (deprecated aliases excluded)."""
    deprecated = set(treg._deprecated_models)
    archs = set()
    for module in (module for family in FAMILIES for module in family.timm_modules):
        archs |= treg._module_to_models.get(module, set())
    archs = sorted(a for a in archs - deprecated if (facts := arch_facts(a)) is not None and facts.refusal is None)
    return tuple(archs) + tuple(SHORT_NAMES)


def _unserved_archs() -> Dict[str, str]:
    """Architectures refused, with why (their names take no method tag)."""
    deprecated = set(treg._deprecated_models)
    unserved = {}
    for arch in (arch for family in FAMILIES for module in family.timm_modules
                 for arch in treg._module_to_models.get(module, set()) - deprecated):
        facts = arch_facts(arch)
        if facts is not None and facts.refusal is not None:
            unserved[arch] = facts.refusal
    for module, why in UNSERVED_MODULES.items():
        unserved.update({arch: why for arch in treg._module_to_models.get(module, set()) - deprecated})
    return unserved


def register_all() -> bool:
    """Wrap the supported entry points, register the short names, list the tagged names, and let timm's
    lookups by name resolve every method-tagged name. Idempotent. Where this timm's private registry or factory
    differs from what they read, the names are not registered and a warning says so, naming the timm version:
    apply, remove, set_params and the commands on plain names work without them. True when registered."""
    why = _PRIVATE_MISSING or _registry_differs()
    if why is None:
        _register_all()  # what it reads was checked: an error here is timm_tokcomp's, and it is raised
        return True
    warnings.warn(f"timm {timm.__version__}: its private model registry differs from what timm_tokcomp reads "
                  f"({why}), so the method-tagged names (deit_small.tome_r16, ...) are not registered; "
                  f"timm_tokcomp.apply(model, method, ...) works on the plain model", RuntimeWarning, stacklevel=2)
    return False


# what _register_all reads of timm's private registry and factory, and the kind each must be
_PRIVATE_TABLES = {"_model_entrypoints": dict, "_model_pretrained_cfgs": dict, "_model_has_pretrained": set,
                   "_model_with_tags": dict, "_model_to_module": dict, "_module_to_models": dict,
                   "_deprecated_models": dict}
_PRIVATE_FUNCTIONS = ("split_model_name_tag", "register_model", "model_entrypoint")


def _registry_differs() -> Optional[str]:
    """What of timm's private registry and factory differs from what _register_all reads, or None: every table it
    reads, of its kind (or one of ours, from an earlier registration), every function, and one of the factory's two
    doors for a model name."""
    for name, kind in _PRIVATE_TABLES.items():
        table = getattr(treg, name, None)
        if table is None:
            return f"AttributeError: timm.models._registry has no {name}"
        if not isinstance(table, kind):
            return f"TypeError: timm.models._registry.{name} is a {type(table).__name__}, not a {kind.__name__}"
    for name in _PRIVATE_FUNCTIONS:
        if not callable(getattr(treg, name, None)):
            return f"AttributeError: timm.models._registry.{name} is not a function"
    if not callable(getattr(_factory, "_resolve_model_source", None)) and \
            not callable(getattr(_factory, "split_model_name_tag", None)):
        return "AttributeError: timm.models._factory has neither _resolve_model_source nor split_model_name_tag"
    return None


def _register_all() -> None:
    for arch in supported_archs():
        if arch in SHORT_NAMES:
            continue
        fn = treg._model_entrypoints[arch]
        if not hasattr(fn, "tokcomp_original"):
            treg._model_entrypoints[arch] = _wrap_entrypoint(arch, fn)
    for arch, why in _unserved_archs().items():
        fn = treg._model_entrypoints[arch]
        if not hasattr(fn, "tokcomp_original"):
            treg._model_entrypoints[arch] = _refusing_entrypoint(arch, why, fn)
    _register_short_names()
    for arch in supported_archs():
        _list_method_names(arch)
    _supported.cache_clear()
    resolve = getattr(_factory, "_resolve_model_source", None)  # timm >= 1.0.31; older versions resolve inline
    if resolve is not None and not hasattr(resolve, "tokcomp_original"):
        _factory._resolve_model_source = _keep_method_tag(resolve)
    elif resolve is None and not hasattr(_factory.split_model_name_tag, "tokcomp_original"):
        _factory.split_model_name_tag = _remember_method_tag(_factory.split_model_name_tag)
    if type(treg._model_pretrained_cfgs) is dict:
        treg._model_pretrained_cfgs = _PretrainedCfgs(treg._model_pretrained_cfgs)
    if type(treg._model_has_pretrained) is set:
        treg._model_has_pretrained = _HasPretrained(treg._model_has_pretrained)
