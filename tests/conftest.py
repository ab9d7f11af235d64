import os

# the Triton kernels run in Triton's CPU interpreter in these tests: must be set before they are defined
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest
import torch
from PIL import Image
from timm.layers import Attention
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer

DATA = Path(os.environ.get("TOKCOMP_DATA", Path(__file__).resolve().parents[1] / ".." / "shared" / "data"))

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


def positions_seen(model, images):
    """Run model on images, returning (plan kind, coords before, coords after) of every rotary-position reduction."""
    from timm_tokcomp.rope import TokenPositions

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


def make_model(variant: str, fused: bool = True, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = VARIANTS[variant]().eval()
    for blk in model.blocks:
        blk.attn.fused_attn = fused
    return model


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """20 random 48 x 48 JPEGs, for training and calibration runs."""
    folder = tmp_path_factory.mktemp("images")
    g = torch.Generator().manual_seed(0)
    for i in range(20):
        pixels = (torch.rand(48, 48, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(folder / f"img_{i:03d}.jpg")
    return folder


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
