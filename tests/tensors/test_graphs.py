"""The CUDA-graph path (timm_tokcomp.runtime.graphs): what decides capturability is checked on the CPU; the capture
itself and its replays run where CUDA is available."""
import os
import time

import pytest
import timm
import torch

import timm_tokcomp
from timm_tokcomp.runtime.graphs import GraphedForward, check_capturable, host_syncs
from conftest import make_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@pytest.mark.parametrize("name", ["tome_r8", "evit_r4", "dense_tome_r1", "topk_k70", None])
def test_fixed_count_forwards_are_capturable(name):
    model = timm.create_model("deit_tiny_patch16_224" + (f".{name}" if name else "")).eval()
    x = torch.randn(1, 3, 224, 224)
    assert host_syncs(model, x) == {}
    check_capturable(model, x)


def test_a_cache_built_on_the_first_forward_does_not_refuse_capture():
    """Counted on a second forward: what a first one builds once (radial patterns' keep index from host data; on a
    GPU a blocking copy) is built by the warm-up forwards before a capture too."""
    calls = []

    class FirstCallReadsTheHost(torch.nn.Module):
        def forward(self, x):
            if not calls:
                calls.append(float(x.sum()))  # a host wait, once
            return x * 2

    assert host_syncs(FirstCallReadsTheHost().eval(), torch.ones(2)) == {} and len(calls) == 1
    check_capturable(timm.create_model("deit_tiny_patch16_224.l2_k70").eval(), torch.randn(1, 3, 224, 224))


def test_data_dependent_counts_and_training_mode_are_refused():
    model = timm.create_model("deit_tiny_patch16_224.atm").eval()
    x = torch.randn(1, 3, 224, 224)
    syncs = host_syncs(model, x)
    assert syncs.get("aten._local_scalar_dense.default", 0) > 0
    with pytest.raises(ValueError, match=r"waits for the device \d+ times .*\(ATM, ATS\)"):
        check_capturable(model, x)
    model = timm_tokcomp.apply(make_model("cls"), "tome", r=4).train()
    with pytest.raises(ValueError, match=r"eval mode"):
        check_capturable(model, torch.randn(1, 3, 32, 32))


def test_capture_needs_a_cuda_example_and_a_positive_warmup():
    model = timm_tokcomp.apply(make_model("cls").eval(), "tome", r=4)
    with pytest.raises(ValueError, match="example must be a CUDA tensor"):
        GraphedForward(model, torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match="warmup must be an integer >= 1, got 0"):
        GraphedForward(model, torch.randn(1, 3, 32, 32), warmup=0)


@needs_cuda
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_graph_replays_the_eager_forward(kernel):
    """Replays equal eager forwards on new inputs (the same kernels, so the same bits), each call returns its own
    tensor, the capture takes well under the issue's 60 s, and other shapes are refused."""
    if kernel == "triton" and os.environ.get("TRITON_INTERPRET") == "1":  # conftest's default, for CPU tensors
        pytest.skip("the compiled kernels on CUDA: run `TRITON_INTERPRET=0 pytest tests/tensors/test_graphs.py` on the GPU "
                    "(Triton's interpreter on CUDA tensors is not what users run, and failed on an H200)")
    model = timm.create_model("deit_small_patch16_224").cuda().eval()
    timm_tokcomp.apply(model, "tome", r=16, kernel=kernel)
    example = torch.randn(4, 3, 224, 224, device="cuda")
    start = time.perf_counter()
    graphed = GraphedForward(model, example)
    assert time.perf_counter() - start < 60
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(4, 3, 224, 224, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
            first = graphed(x)
            torch.testing.assert_close(first, model(x), rtol=0, atol=1e-5)
        assert graphed(x).data_ptr() != first.data_ptr()
    with pytest.raises(ValueError, match="capture another GraphedForward"):
        graphed(torch.randn(2, 3, 224, 224, device="cuda"))


@pytest.mark.parametrize("name, made_inside", [("vit_small_patch16_dinov3", 1), ("vit_small_patch16_dinov3.tome_r8", 0)])
def test_rope_tables_are_made_once_for_a_capture(name, made_inside):
    """timm's DINOv3 rope copies a CPU grid to the device in each forward (an H200 capture failed on it): inside
    fixed_rope_tables the table is made by the first forward and reused, the outputs are unchanged, and the rope
    module gets its own get_embed back afterwards. A reduced model's rope made its table once already, at the
    forward before (rope.RotaryEmbeddingDinoV3Once)."""
    from timm.layers.pos_embed_sincos import RotaryEmbeddingDinoV3
    from timm_tokcomp.runtime.graphs import fixed_rope_tables
    model = timm.create_model(name, img_size=64).eval()
    rope = next(m for m in model.modules() if isinstance(m, RotaryEmbeddingDinoV3))
    made = []
    original = RotaryEmbeddingDinoV3._create_embed
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        want = model(x)
        tables = {}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(RotaryEmbeddingDinoV3, "_create_embed", lambda self, *a, **k: made.append(1) or original(self, *a, **k))
            with fixed_rope_tables(model, tables):
                outs = [model(x) for _ in range(3)]
        assert len(made) == made_inside and len(tables[id(rope)]) == 1
        for out in outs:
            torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert "get_embed" not in vars(rope)
    model.train()
    with fixed_rope_tables(model, {}):
        assert "get_embed" not in vars(rope)  # training mode: its coordinate augmentation stays per forward
