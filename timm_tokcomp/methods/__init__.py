"""Token-reduction methods by name, and their name tags (`tome_r16`, `evit_r8`, `topk_k70`, `atm`,
`atm_<preset>`, `dense_tome_r8`, `patchmerger_k70`, `dynamicvit_k70`, ...)."""
import re
from typing import Any, Dict, List, Optional, Tuple, Type

from ..utils.checks import check_choice
from .base import TokenReducer
from .params import REQUIRED
from .register import METHODS, register_method
# every method module, in the order listings show the methods (each class registers itself: @register_method)
from .tome import ToMe
from .evit import EViT
from .atm import ATM
from .dense_tome import DenseToMe
from .topk import TopK
from .ats import ATS
from .radial import RadialL1, RadialL2, RadialLInf
from .kmedoids import KMedoids
from .dpcknn import DPCKNN
from .pyra import PYRA
from .patchmerger import PatchMerger
from .dynamicvit import DynamicViT
from .sinkhorn import Sinkhorn
from .sit import SiT
from .tofu import ToFu
from .pitome import PiToMe
from .dct import DCT
from .atc import ATC
from .mctf import MCTF
from .repshift import RepShift
from .crossget import CrossGET
from .cubist import CubistMerge
from .dymu import DyMU
from .diffrate import DiffRate
from .ltmp import LTMP
from .fpet import FPET
from .dtem import DTEM
from .visionzip import VisionZip

__all__ = ["METHODS", "register_method", "TokenReducer", "REQUIRED", "ToMe", "EViT", "ATM", "DenseToMe", "TopK", "ATS",
           "RadialL1", "RadialL2", "RadialLInf", "KMedoids", "DPCKNN", "PYRA", "PatchMerger", "DynamicViT", "Sinkhorn",
           "SiT", "ToFu", "PiToMe", "DCT", "ATC", "MCTF", "RepShift", "CrossGET", "CubistMerge", "DyMU", "DiffRate",
           "LTMP", "FPET", "DTEM", "VisionZip", "method_class", "TAG_FORMS", "TAG_SUMMARY"]

TAG_FORMS = tuple(form for cls in METHODS.values() for form in cls.tag_forms())


def _summary(forms: Tuple[str, ...]) -> str:
    """The forms, with ATM's operating-point presets (atm_g<..>, atm_mae_g<..>) as one item, and the methods whose
    only forms are '<name>_r<k>, <name>_k<pct>' after the first of them as one item: errors and help stay a few
    lines."""
    points = [f for f in forms if re.fullmatch(r"atm_(mae_)?g\d+", f)]
    plain = [name for name, cls in METHODS.items() if cls.tag_forms() == (f"{name}_r<k>", f"{name}_k<pct>")]
    alike = {form for name in plain[1:] for form in (f"{name}_r<k>", f"{name}_k<pct>")}
    shown = [f for f in forms if f not in points and f not in alike]
    if points:
        at = shown.index("atm_fast") + 1 if "atm_fast" in shown else len(shown)
        shown.insert(at, f"atm_g<GFLOPs> / atm_mae_g<GFLOPs> ({len(points)} operating points of the ATM paper; "
                         "`tokcomp methods` or timm_tokcomp.methods.TAG_FORMS list them)")
    if alike:
        at = shown.index(f"{plain[0]}_k<pct>") + 1
        shown.insert(at, f"the same two forms for {', '.join(plain[1:])}")
    return ", ".join(shown)


TAG_SUMMARY = _summary(TAG_FORMS)
# what --help lists: the method families and an example tag of each kind; `tokcomp methods` lists every form
FAMILIES = (f"{', '.join(METHODS)}; tags such as tome_r16, tome_high, evit_k70, atm_fast, dense_tome_r8 "
            f"(tokcomp methods lists every form)")


# the lists the commands read, each from the methods' declared traits (TokenReducer), at the time of the call
def exportable_methods() -> Tuple[str, ...]:
    """Methods whose reduced models export to ONNX."""
    return tuple(name for name, cls in METHODS.items() if cls.exportable())


def tocom_methods() -> Tuple[str, ...]:
    """Methods ToCom compensators serve."""
    return tuple(name for name, cls in METHODS.items() if cls.spec.tocom_compatible)


def listed_tags() -> Tuple[str, ...]:
    """Tags timm.list_models(pretrained=True) shows on every served pretrained name."""
    return tuple(tag for cls in METHODS.values() for tag in cls.spec.listed_tags)


def default_tune_space() -> Tuple[Tuple[str, Dict[str, Any]], ...]:
    """`tokcomp tune`'s default candidates: every method's declared settings, in METHODS order."""
    return tuple((name, dict(params)) for name, cls in METHODS.items() for params in cls.spec.tune_space)


def parameter_table() -> List[Tuple[str, str, str, str]]:
    """(parameter, default, its one-line help, the methods that declare it so) per distinct declaration, in METHODS
    order: what `tokcomp methods` lists and the docs' parameter table shows."""
    rows: Dict[Tuple[str, str, str], List[str]] = {}
    for name, cls in METHODS.items():
        for param in cls.spec.params:
            default = "required" if param.default is REQUIRED else repr(param.default)
            rows.setdefault((param.name, default, param.help), []).append(name)
    return [(param, default, help_, "all" if len(names) == len(METHODS) else ", ".join(names))
            for (param, default, help_), names in rows.items()]


def parameter_markdown() -> str:
    """parameter_table() as the Markdown table docs/methods.md carries."""
    lines = ["| parameter | default | what it sets | methods |", "| --- | --- | --- | --- |"]
    lines += [f"| `{p}` | `{d}` | {h} | {m} |" for p, d, h, m in parameter_table()]
    return "\n".join(lines)


def method_class(method: str) -> Type[TokenReducer]:
    return METHODS[check_choice("method", method, sorted(METHODS))]


def make_reducer(method: str, **params: Any) -> TokenReducer:
    """Build a method by name, e.g. make_reducer("tome", r=16). Raises ValueError / TypeError naming
    the bad parameter (TokenReducer.__init__ checks each once)."""
    return method_class(method)(**params)


def match_method_tag(tag: str) -> Optional[Tuple[str, Dict[str, Any]]]:
    """'tome_r16' -> ('tome', {'r': 16}); 'atm_lossless' -> ('atm', {'preset': 'lossless'}); None for a tag that is
    no method's."""
    for name, cls in METHODS.items():
        params = cls.parse_tag(tag)
        if params is not None:
            return name, params
    return None


def parse_method_tag(tag: str) -> Tuple[str, Dict[str, Any]]:
    """match_method_tag, raising ValueError listing the valid forms for a tag that is no method's."""
    found = match_method_tag(tag)
    if found is None:
        refuse_tagless_method(tag, f"unknown token-reduction tag {tag!r}")
        raise ValueError(f"unknown token-reduction tag {tag!r}; valid forms: {TAG_SUMMARY} (k >= 0)")
    return found


def refuse_tagless_method(tag: str, error: str) -> None:
    """A tag spelled as a method that has no tag form (DyMU: thresholds calibrated per model): ValueError naming
    that method's route (its tag_legend) after `error`."""
    prefix = tag.split("_")[0]
    if prefix in METHODS and not any(form == prefix or form.startswith(f"{prefix}_") for form in TAG_FORMS):
        raise ValueError(f"{error}: {METHODS[prefix].tag_legend()}")


def is_method_tag(tag: str) -> bool:
    return match_method_tag(tag) is not None
