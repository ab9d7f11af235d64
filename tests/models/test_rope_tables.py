"""A reduced rope model reads its rope table and grid, it does not build them per forward: timm's DINOv3 rope builds
its grid on the host and copies it to the device in every forward (a copy a CUDA graph cannot capture, and a host
tensor inside a compiled graph); a patched model's DINOv3 rope makes its table once per grid and device, and under
torch.compile builds grid and table on the images' device."""
import pytest
import torch
from timm.layers.pos_embed_sincos import RotaryEmbeddingDinoV3

import timm_tokcomp
from conftest import family_model
from timm_tokcomp.runtime import compile as compiling
from timm_tokcomp.ops.rope import RotaryEmbeddingDinoV3Once
from test_compiled_whole import InGraphs


def _counting_builds(monkeypatch):
    made = []
    original = RotaryEmbeddingDinoV3._create_embed
    monkeypatch.setattr(RotaryEmbeddingDinoV3, "_create_embed",
                        lambda self, *a, **k: made.append(1) or original(self, *a, **k))
    return made


def test_a_patched_dinov3_makes_its_rope_table_once_and_stays_timms_model_bit_for_bit(monkeypatch, images):
    plain = family_model("dinov3_registers")
    assert plain.dynamic_img_size and type(plain.rope) is RotaryEmbeddingDinoV3  # the per-forward table
    made = _counting_builds(monkeypatch)
    with torch.no_grad():
        want = [plain(images) for _ in range(2)]
        assert len(made) == 2  # timm's: one table per forward
        model = timm_tokcomp.apply(family_model("dinov3_registers"), "tome", r=0)
        assert type(model.rope) is RotaryEmbeddingDinoV3Once
        made.clear()
        for out in [model(images) for _ in range(3)]:
            torch.testing.assert_close(out, want[0], rtol=0, atol=0)
        assert len(made) == 1
        other = images[:, :, :24, :24]  # another grid: its own table, made once
        for _ in range(2):
            torch.testing.assert_close(model(other), plain(other), rtol=0, atol=0)
        assert len(made) == 2 + 2  # once for the patched model, twice for the plain one
    model.rope.periods.mul_(2.0)  # a change in place: the next table is made anew, as timm's would be
    plain.rope.periods.mul_(2.0)
    with torch.no_grad():
        torch.testing.assert_close(model(images), plain(images), rtol=0, atol=0)
    model.to(torch.float64), plain.to(torch.float64)  # the table in the periods' new dtype, as timm's
    with torch.no_grad():
        torch.testing.assert_close(model(images.double()), plain(images.double()), rtol=0, atol=0)
    model.float(), plain.float()
    model.rope.periods.div_(2.0)  # back as built (exact: a power of two)
    timm_tokcomp.remove(model)
    assert type(model.rope) is RotaryEmbeddingDinoV3
    with torch.no_grad():
        torch.testing.assert_close(timm_tokcomp.apply(model, "tome", r=2)(images),
                                   timm_tokcomp.apply(family_model("dinov3_registers"), "tome", r=2)(images),
                                   rtol=0, atol=0)


def test_coordinate_augmentation_in_training_still_draws_a_table_per_forward(monkeypatch, images):
    model = timm_tokcomp.apply(family_model("dinov3_registers", rope_shift_coords=0.5), "tome", r=2)
    assert model.rope.aug_active
    made = _counting_builds(monkeypatch)
    model.train()
    model(images)
    model(images)
    assert len(made) == 2


@pytest.mark.parametrize("name", ["dinov3_registers", "eva02_cat_swiglu"])
def test_a_compiled_rope_model_builds_its_grid_on_the_images_device(fresh_dynamo, name, images):
    """Every grid a compiled forward builds (arange / linspace in a captured graph) is made on the device the graph
    runs on, not on the host and copied: no host tensor in a graph (on a GPU, Inductor's CUDA graphs skip a graph
    holding one)."""
    model, recorder = timm_tokcomp.apply(family_model(name), "tome", r=2), InGraphs()
    fast = compiling.compile(model, backend=recorder.backend)
    with torch.no_grad():
        torch.testing.assert_close(fast(images), model(images), rtol=1e-5, atol=1e-5)
    made = [node for graph in recorder.graphs for node in graph.nodes
            if node.op == "call_function" and getattr(node.target, "__name__", "") in ("arange", "linspace")]
    assert made and all(node.kwargs.get("device") is not None for node in made)


def test_the_stats_kept_after_a_forward_hold_no_rope_rows(images):
    """last_stats keeps where the tokens sit, not the rope rows the blocks after the last reduction computed (for a
    'mixed' rope a (B, heads, n, 2 * head_dim) tensor a block, held until the next forward)."""
    model = timm_tokcomp.apply(family_model("ropevit_mixed"), "evit", keep_rate=0.7, stages=(2,))
    with torch.no_grad():
        model(images)
    positions = timm_tokcomp.last_stats(model).positions
    assert positions.coords.shape[:2] == (3, 11) and positions._rows == []  # 16 patches, 5 pruned before block 2
    torch.testing.assert_close(positions.rows(2), positions.settled().rows(2), rtol=0, atol=0)  # computed on demand
