import hashlib
import io
import os
import warnings
from dataclasses import dataclass
from typing import Optional

# the Triton kernels run in Triton's CPU interpreter in these tests: must be set before they are defined
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest
import timm
import torch
from PIL import Image
from timm.layers import Attention
from timm.models.deit import VisionTransformerDistilled
from timm.models.eva import Eva
from timm.models.vision_transformer import VisionTransformer

from timm_tokcomp.methods import METHODS
from timm_tokcomp.methods.base import ScheduledReducer
from timm_tokcomp.plans import Plan, Reduced

# pytest-xdist's workers share the cores: each takes its part of them for torch's threads
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

REPO = Path(__file__).resolve().parents[1]  # the repository's root
DATA = Path(os.environ.get("TOKCOMP_DATA", REPO / ".." / "shared" / "data"))

SMALL = dict(img_size=32, patch_size=4, embed_dim=48, depth=4, num_heads=3, num_classes=10)

# name -> constructor of a small randomly initialised model covering one feature of timm's ViT
VARIANTS = {
    "cls": lambda: VisionTransformer(**SMALL),
    "distilled": lambda: VisionTransformerDistilled(**SMALL),
    "registers": lambda: VisionTransformer(reg_tokens=3, **SMALL),
    "layerscale_qknorm": lambda: VisionTransformer(init_values=0.1, qk_norm=True, **SMALL),
    "avgpool_noclass": lambda: VisionTransformer(class_token=False, global_pool="avg", **SMALL),
    "attn_dim": lambda: _with_attn_dim(VisionTransformer(**SMALL), head_dim=8),
}


def _with_attn_dim(model, head_dim):
    """Give every block an Attention whose heads * head_dim differs from the embedding dim."""
    for blk in model.blocks:
        blk.attn = Attention(SMALL["embed_dim"], num_heads=SMALL["num_heads"], attn_head_dim=head_dim, qkv_bias=True)
    return model


def reducing_setting(cls, r: int, study: dict) -> dict:
    """A setting that reduces, for the tests run over every method: `study` where the method takes keep_rate, r = `r`
    where it takes r, else its defaults (DiffRate's untrained rates reduce from block 1 on)."""
    names = cls.param_names()
    return dict(study) if "keep_rate" in names else {"r": r} if "r" in names else {}


def thresholds(depth: int, merge: float, prune: float = 0.0):
    """LTMP thresholds for depth blocks: merge above cosine `merge`, prune below importance `prune` / 1000."""
    from timm_tokcomp.methods.ltmp import LTMPParams

    params = LTMPParams(depth)
    with torch.no_grad():
        params.merge.fill_(merge)
        params.prune.fill_(prune)
    return params


# the token-reducing methods, and a setting of each that reduces a small model (the tests run over every method)
TOKEN_METHODS = sorted(name for name, cls in METHODS.items() if not cls.spec.dense)
_REDUCING_PARAMS = {"atm": dict(alpha=0.2, beta=0.0, theta_min=0.2, prefix_only_last_block=False),
                    "ltmp": lambda depth: dict(threshold_params=thresholds(depth, merge=0.0, prune=2.0)),
                    "dymu": lambda depth: dict(thresholds=[0.0] * depth),
                    "visionzip": dict(dominant=4, contextual=2, block=1)}


def reducing_params(method: str, depth: int) -> dict:
    """Parameters with which `method` reduces a small model of `depth` blocks."""
    params = _REDUCING_PARAMS.get(method, reducing_setting(METHODS[method], 4, {"keep_rate": 0.5, "stages": (2, 3)}))
    return params(depth) if callable(params) else params


def positions_seen(model, images):
    """Run model on images, returning (plan kind, coords before, coords after) of every rotary-position reduction."""
    from timm_tokcomp.ops.rope import TokenPositions

    seen = []
    original = TokenPositions.reduced

    def spy(self, plan, size, num_prefix):
        out = original(self, plan, size, num_prefix)
        seen.append((type(plan).__name__, self.coords, out.coords))
        return out

    TokenPositions.reduced = spy
    try:
        with torch.no_grad():
            model(images)
    finally:
        TokenPositions.reduced = original
    return seen


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int = 1) -> None:
    """got and want equal in shape and dtype and at most `ulps` units in the last place apart, element by
    element: for a transcendental function (log, exp, ...) computed by two implementations (Triton's interpreter
    through NumPy, torch's vectorised CPU code, a GPU), which round its last bit each their own way (NumPy's and
    torch's float32 log(7) differ by one ulp on AVX-512 CPUs). Exact values (log(1) = 0) must stay exact."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    assert got.dtype.is_floating_point, got.dtype
    spacing = torch.nextafter(want.abs(), torch.full_like(want, float("inf"))) - want.abs()
    far = (got - want).abs() > ulps * spacing
    assert not far.any(), (f"{int(far.sum())} of {want.numel()} elements over {ulps} ulp: {got[far][:5]} vs "
                           f"{want[far][:5]}")


def op_counts(model: torch.nn.Module, x: torch.Tensor):
    """The aten ops, kernel launches and host synchronisations of model(x) under no_grad, after one call that warms
    it (measure.OpCounter)."""
    from timm_tokcomp.measure.counting import OpCounter

    with torch.no_grad():
        model(x)
        with OpCounter() as counted:
            model(x)
    return counted


def make_model(variant: str, fused: bool = True, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = VARIANTS[variant]().eval()
    for blk in model.blocks:
        blk.attn.fused_attn = fused
    return model


def pytest_collection_modifyitems(config, items):
    """Tests on the real data are slow: `-m "not slow"` (CONTRIBUTING.md's inner loop) leaves them out too."""
    for item in items:
        if item.get_closest_marker("realdata") is not None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """20 random 48 x 48 JPEGs, for training and calibration runs."""
    folder = tmp_path_factory.mktemp("images")
    g = torch.Generator().manual_seed(0)
    for i in range(20):
        pixels = (torch.rand(48, 48, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(folder / f"img_{i:03d}.jpg")
    return folder


@pytest.fixture(scope="module")
def unlabelled_folder(tmp_path_factory):
    """100 random 40 x 40 JPEGs, no labels: a folder for --data that needs no real data."""
    folder = tmp_path_factory.mktemp("unlabelled")
    g = torch.Generator().manual_seed(0)
    for i in range(100):
        Image.fromarray((torch.rand(40, 40, 3, generator=g) * 255).to(torch.uint8).numpy()).save(folder / f"{i}.jpg")
    return folder


@pytest.fixture
def fresh_dynamo():
    """dynamo's caches and counters (torch._dynamo.utils.counters) emptied before the test, the caches after it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def images():
    torch.manual_seed(1)
    return torch.randn(3, 3, 32, 32)


def require_data():
    if not (DATA / "deit_tiny_patch16_224.safetensors").is_file():
        pytest.skip(f"real data not found at {DATA} (set TOKCOMP_DATA)")
    return DATA


def real_model_and_images(name: str, count: int):
    """timm model `name` (a DeiT-Tiny architecture, tags allowed) with the real weights, in eval mode, and the
    first `count` images of imagenet-val-1300 through its eval transform: (count, 3, 224, 224). Skips without
    the real data."""
    import timm

    data = require_data()
    model = timm.create_model(name, checkpoint_path=str(data / "deit_tiny_patch16_224.safetensors")).eval()
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model))
    dataset = timm.data.create_dataset("", root=str(data / "imagenet-val-1300" / "images"))
    return model, torch.stack([transform(dataset[i][0].convert("RGB")) for i in range(count)])


# the families' small models (tests/models/test_families.py and every test that runs a family)
FAMILY_SMALL = dict(img_size=32, patch_size=8, embed_dim=64, num_heads=2, depth=3, num_classes=10)
# name -> a small version of a real timm architecture (its own config: rope type, head, registers, MLP, qkv)
FAMILY_MODELS = {
    "siglip_map": ("vit_base_patch16_siglip_224", {}),
    "siglip2_map": ("vit_base_patch16_siglip_256", {}),
    "eva02_cat_swiglu": ("eva02_small_patch14_224", {}),
    "eva02_swiglu_scale_mlp": ("eva02_base_patch14_224", {}),
    "dinov3_registers": ("vit_small_patch16_dinov3", {}),
    "pe_core_rope_map": ("vit_pe_core_base_patch16_224", {}),
    "ropevit_mixed": ("vit_small_patch16_rope_mixed_224", {}),
    "rope_split_qkv_layerscale": ("vit_small_patch16_rope_224", dict(qkv_fused=False, init_values=0.1, qk_norm=True)),
    "rope_grouped_query": ("vit_small_patch16_rope_224", dict(qkv_fused=False, num_kv_heads=1)),
}


def family_model(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A small random model of a family (FAMILY_MODELS[name]), its 1-d parameters spread around their init."""
    arch, extra = FAMILY_MODELS[name]
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = timm.create_model(arch, **{**FAMILY_SMALL, **extra, **overrides}).eval()
    for p in model.parameters():  # LayerScale / head inits near zero would hide differences
        if p.dim() == 1 and torch.all(p == p.flatten()[0]):
            p.data.normal_(1.0 if p.flatten()[0] != 0 else 0.0, 0.1)
    return model


def _random_compensator(depth=SMALL["depth"], dim=SMALL["embed_dim"], attn_dim=SMALL["embed_dim"], steps=16, seed=0):
    from timm_tokcomp.tocom import Compensator

    g = torch.Generator().manual_seed(seed)
    return Compensator(torch.randn(steps, depth, 2, 2, dim, generator=g),
                       torch.randn(steps, depth, 2, attn_dim, 2, generator=g), scale=0.1)


def _hub_cache(cache: Path, repo_id: str, source: Path, commit: str) -> None:
    """Lay out `source` as huggingface_hub's cache does: blobs by hash, snapshot symlinks, refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    for f in sorted(p for p in source.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / f.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


def eva_from_deit(deit: torch.nn.Module) -> Eva:
    """An Eva (absolute position embedding, no rope, GELU MLP, fused qkv, class token) holding deit's weights."""
    eva = Eva(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3, global_pool="token",
              use_fc_norm=False, use_post_transformer_norm=True, num_classes=1000).eval()
    state = {}
    for key, value in deit.state_dict().items():
        if key.endswith("attn.qkv.bias"):
            q, k, v = value.chunk(3)
            state[key.replace("qkv.bias", "q_bias")], state[key.replace("qkv.bias", "v_bias")] = q, v
            eva.get_submodule(key.rpartition(".qkv")[0]).k_bias.copy_(k)  # a non-persistent buffer in Eva
        elif ".ls" not in key:
            state[key] = value
    eva.load_state_dict(state)
    return eva


# ------------------------------------------------------------------ a new method, declared as the recipe says
# (CONTRIBUTING.md): its class with its own plan kinds, registered in METHODS (the toy_method fixture). The tests
# walk it through the stack: bench, speed, tune, export and `tokcomp methods` (tests/kit/test_kit.py), a rope model,
# and a fine-tuning run through the training engine (tests/commands/test_finetune.py).
TOY_EPS = 1e-6  # the size a token the training step drops keeps


@dataclass
class KeepLastPlan(Plan):
    """A toy plan kind (its own apply and at_destinations, no line anywhere else): keep the prefix tokens and the last
    num_keep others."""

    num_prefix: int
    num_keep: int

    def _keep(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else torch.cat([t[:, :self.num_prefix], t[:, t.shape[1] - self.num_keep:]], dim=1)

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        return self._keep(x), self._keep(size), self._keep(source)

    def at_destinations(self, t: torch.Tensor) -> torch.Tensor:
        return t[:, t.shape[1] - self.num_keep:]


@dataclass
class KeepLastStepPlan(Plan):
    """The toy's training step: every token stays in place, those KeepLastPlan would drop get size TOY_EPS (the
    log-size bias keeps them out of attention); counts its applications in `applied`."""

    num_prefix: int
    num_keep: int
    keeps_positions = True  # no token moves
    applied = 0

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        type(self).applied += 1
        size = x.new_ones(x.shape[0], x.shape[1], 1) if size is None else size
        dropped = torch.zeros_like(size, dtype=torch.bool)
        dropped[:, self.num_prefix:x.shape[1] - self.num_keep] = True
        return x, size.masked_fill(dropped, TOY_EPS), source


class KeepLast(ScheduledReducer):
    """A toy method with its own plan kinds: each reducing block keeps its last tokens; where gradients flow (training)
    its step drops the others softly, in place."""

    spec = ScheduledReducer.spec.but(
        name="toykeep",
        data_dependent=True,  # declared so, to see speed and tune keep it to eager mode
        export_refusal="a toy method for the tests",
        tune_space=({"r": 2},))

    def default_prop_attn(self, global_pool: str) -> bool:
        return True  # the training step's sizes must reach attention

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k

    def plan(self, metric: torch.Tensor, r: int, num_prefix: int, size: Optional[torch.Tensor]) -> Optional[Plan]:
        if r <= 0:
            return None
        kind = KeepLastStepPlan if torch.is_grad_enabled() and metric.requires_grad else KeepLastPlan
        return kind(num_prefix, metric.shape[2] - num_prefix - r)


@pytest.fixture
def toy_method(monkeypatch):
    monkeypatch.setitem(METHODS, KeepLast.name, KeepLast)  # what @register_method does, undone after the test
    return KeepLast.name


def check_edges(model: torch.nn.Module, x: torch.Tensor, empty_shape: tuple,
                bf16_within: Optional[float] = None) -> torch.Tensor:
    """The edge checks a family's or method's test shares, on a model in eval mode: an empty batch gives
    empty_shape; under bf16 autocast the output is finite (and within bf16_within of fp32's where given);
    torch.save / torch.load of the whole model gives the same output. Returns the fp32 output on x."""
    with torch.no_grad():
        out = model(x)
        assert model(x[:0]).shape == empty_shape
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(x)
        assert low.dtype == torch.bfloat16 and torch.isfinite(low).all()
        if bf16_within is not None:
            assert (low.float() - out).abs().max() < bf16_within
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        assert torch.equal(torch.load(buffer, weights_only=False)(x), out)
    return out
