"""What a method is, apart from what it does: its MethodSpec, as peft keeps a tuner's config apart from its layer.
The spec names the method, declares its parameters and tag forms, and holds the traits the loop and the commands
read (where it reduces, whether it keeps every token, exports, compiles by region, ...). The hooks (settings, metric,
plan) stay in the reducer class, which carries its spec as `spec` and registers with @register_method. A method
derives its spec from its base's: spec = ScheduledReducer.spec.but(name="mine", tune_space=({"r": 8},))."""
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..utils.checks import Param, check_choice
from .params import COMMON
from .places import ReducesAt
from .tags import TagForm

HOLDS_PATCHES = ("whole", "dropped", "soft", "similarity")


@dataclass(frozen=True)
class MethodSpec:
    """name: the method's name ('' for a base no one applies); params: its parameters, in order; tags: its tag forms,
    tried in order; tag_legend: what its own forms mean, for `tokcomp methods` ('' where the shared legend says it).

    Traits of its blocks: place (where they reduce); dense (keeps every token: merge before the MLP, unmerge after);
    needs_class_token (ranks tokens by the class token's attention); masks_by_size (pads images to one count with
    size-0 tokens, so prop_attn stays on); holds_patches (how the source map holds the patches: 'whole', each by one
    token; 'dropped', a pruned patch by none; 'soft', shared out by weights summing to 1; 'similarity', a merged
    token's size grows by its similarity to its keeper); batch_adaptive (the token count is decided per batch, so a
    batch differs from its images); reads_grid (its settings read the input's patch grid); reads_branches (its plan
    reads the block's branch outputs, not attention); keeps_grid (its plans keep the patch tokens a complete grid, as
    a windowed encoder needs); default_prefix_only_last_block.

    Traits the commands read: data_dependent (token counts read from the data: eager only in speed / tune, no CUDA
    graph, no ONNX); compiles_by_region (torch.compile traces its block once, the token count symbolic; False: its
    plan reads a per-block Python value, so the model compiles whole); export_refusal (why it does not export to ONNX;
    None: it does); tocom_compatible (ToCom compensators serve it); listed_tags (what timm.list_models(pretrained=True)
    shows on every served name); tune_space (its settings in `tokcomp tune`'s default space); learned_class and
    learned_param (the nn.Module class of its learned parameters, and the constructor argument that takes them)."""

    name: str = ""
    params: Tuple[Param, ...] = COMMON
    tags: Tuple[TagForm, ...] = ()
    tag_legend: str = ""
    place: ReducesAt = ReducesAt.AFTER_ATTENTION
    dense: bool = False
    needs_class_token: bool = False
    masks_by_size: bool = False
    holds_patches: str = "whole"
    batch_adaptive: bool = False
    reads_grid: bool = False
    reads_branches: bool = False
    keeps_grid: bool = False
    default_prefix_only_last_block: bool = False
    data_dependent: bool = False
    compiles_by_region: bool = True
    export_refusal: Optional[str] = "it has not been checked against onnxruntime"
    tocom_compatible: bool = False
    listed_tags: Tuple[str, ...] = ()
    tune_space: Tuple[Dict[str, Any], ...] = ()
    learned_class: Optional[type] = None
    learned_param: Optional[str] = None

    def __post_init__(self) -> None:
        check_choice(f"{self.name}: holds_patches", self.holds_patches, HOLDS_PATCHES)
        if (self.learned_class is None) != (self.learned_param is None):
            raise ValueError(f"{self.name}: learned_class and learned_param go together")

    def but(self, **changes: Any) -> "MethodSpec":
        """This spec with `changes` (a derived method's spec)."""
        return dataclasses.replace(self, **changes)

    def parse_tag(self, tag: str) -> Optional[Dict[str, Any]]:
        """The parameters `tag` stands for, from the first of the tag forms that reads it; None if none does."""
        for form in self.tags:
            params = form.parse(self.name, tag)
            if params is not None:
                return params
        return None

    def tag_forms(self) -> Tuple[str, ...]:
        """Every tag form, as listings and errors show it."""
        return tuple(shown for form in self.tags for shown in form.shown(self.name))


# what a method class may not set itself: its spec's fields, and the class attributes they replaced
SPEC_FIELDS = frozenset(field.name for field in dataclasses.fields(MethodSpec)) - {"tags"} | {"PARAMS"}
