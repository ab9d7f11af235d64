"""DTEM: eval mode is ToMe on the learned embedding; the soft selection tends to ToMe's top-r edges; the relaxed merge
keeps every patch's weight and sorts the active tokens; training reaches the embeddings alone through `tokcomp
finetune --lora-rank 0`; saved embeddings reload and are checked against the model."""
import pytest
import timm
import torch

import timm_tokcomp
from conftest import SMALL, make_model
from timm_tokcomp.methods.learned import load_learned, save_learned
from timm_tokcomp.ops.matching import bipartite_soft_matching
from timm_tokcomp.methods.dtem import DTEMParams, soft_selection
from timm_tokcomp.training import FinetuneConfig, finetune, load_finetuned

N_PATCH = (SMALL["img_size"] // SMALL["patch_size"]) ** 2


def test_eval_merges_as_tome_does_on_the_embedding_of_the_attention_input(images):
    torch.manual_seed(0)
    model = timm_tokcomp.apply(make_model("cls"), "dtem", r=6).eval()
    method = timm_tokcomp.get_reducer(model)
    block = model.blocks[0]
    with torch.no_grad():
        x = model._embed(images)[0]
        inputs = block.norm1(x)
        plan = method.plan(inputs, method.settings_for(4, 65, 1, model._tokcomp.block_cost, (8, 8))[0], 1, None)
        want = bipartite_soft_matching(model.tokcomp["dtem"].layers["0"](inputs), 6, 1)
        for field in ("unm_idx", "src_idx", "dst_idx"):
            assert torch.equal(getattr(plan, field), getattr(want, field))
        model(images)
    assert timm_tokcomp.last_stats(model).tokens_per_block == [65, 59, 53, 47]


def test_the_soft_selection_tends_to_tomes_top_r_edges():
    torch.manual_seed(0)
    scores = torch.rand(2, 10, 3).sort(dim=-1, descending=True).values
    chosen = soft_selection(scores, 4)
    assert (chosen >= 0).all() and (chosen.sum(dim=-1) <= 1 + 1e-6).all()  # no A token gives more than itself
    assert (chosen.sum(dim=(1, 2)) <= 4 + 1e-4).all()  # r rounds of mass 1, less what the rows gave above 1
    sharp = soft_selection(torch.arange(30.).view(1, 10, 3).flip(-1) * 0.1, 4)  # well-separated scores
    want = torch.zeros(1, 10, 3)
    want[0, 6:, 0] = 1  # the four A tokens with the best first candidates
    torch.testing.assert_close(sharp, want, atol=1e-3, rtol=0)


def test_the_relaxed_merge_keeps_every_patch_and_sorts_the_active_tokens(images):
    torch.manual_seed(0)
    model = timm_tokcomp.apply(make_model("cls"), "dtem", r=8, trace_source=True).train()
    out = model(images)
    stats = timm_tokcomp.last_stats(model)
    assert stats.tokens_per_block == [N_PATCH + 1] * SMALL["depth"]  # nothing removed
    torch.testing.assert_close(stats.size[..., 0].sum(-1), torch.full((3,), N_PATCH + 1.0), atol=1e-3, rtol=0)
    torch.testing.assert_close(stats.source.sum(1), torch.ones(3, N_PATCH + 1), atol=1e-4, rtol=0)
    active = N_PATCH - 8 * (SMALL["depth"] - 1)  # active after the last block but one
    head = stats.size[:, 1:1 + active, 0]
    assert (head[:, :-1] >= head[:, 1:]).all()
    out.logsumexp(-1).sum().backward()
    layers = model.tokcomp["dtem"].layers  # the last block's merge cannot reach the class token's output
    assert all(layers[str(b)].weight.grad.abs().sum() > 0 for b in range(SMALL["depth"] - 1))


def test_modular_training_through_finetune_trains_the_embeddings_alone(image_folder, tmp_path):
    out = tmp_path / "dtem"
    config = FinetuneConfig(method="dtem_r16", epochs=1, warmup_epochs=0, batch_size=10, distill=True, lora_rank=0)
    finetune("deit_tiny_patch16_224", str(image_folder), str(out), config=config, show_progress=False, num_workers=0)
    assert (out / "dtem.safetensors").is_file() and not (out / "adapter_config.json").exists()
    model = load_finetuned(str(out)).eval()
    torch.manual_seed(0)
    base = timm.create_model("deit_tiny_patch16_224")
    assert torch.equal(model.blocks[3].attn.qkv.weight, base.blocks[3].attn.qkv.weight)
    torch.manual_seed(0)
    start = timm_tokcomp.apply(base, "dtem", r=16).tokcomp["dtem"]
    moved = (model.tokcomp["dtem"].layers["0"].weight - start.layers["0"].weight).abs().max()
    assert 0 < moved < 0.1
    assert model.tokcomp["dtem"].embed_dim == 64


def test_saved_embeddings_reload_and_refuse_another_schedule(tmp_path, images):
    torch.manual_seed(0)
    model = timm_tokcomp.apply(make_model("cls"), "dtem", r=4).eval()
    with torch.no_grad():
        expected = model(images)
    save_learned(model.tokcomp["dtem"], "dtem", tmp_path)
    torch.manual_seed(0)
    again = timm_tokcomp.apply(make_model("cls"), "dtem", r=4, embed_params=load_learned("dtem", tmp_path)).eval()
    with torch.no_grad():
        assert torch.equal(again(images), expected)
    with pytest.raises(ValueError, match=r"blocks \[0, 1, 2, 3\]; .* reduces in blocks \[2\]"):
        timm_tokcomp.apply(make_model("cls"), "dtem", keep_rate=0.5, stages=(4,),
                           embed_params=load_learned("dtem", tmp_path))
    with pytest.raises(ValueError, match="embed_params must be DTEMParams"):
        timm_tokcomp.apply(make_model("cls"), "dtem", r=4, embed_params=torch.nn.Linear(2, 2))
    assert DTEMParams.from_config({"dim": 48, "embed_dim": 16, "blocks": [0]}).embed_dim == 16
