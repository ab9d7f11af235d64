"""The newest surfaces hold, one test per class of defect: data-dependent reductions keep a patch token per image,
every plan kind carries rotary positions under both rope_merge choices, DiffRate's schedule never reduces in block 0,
and the other doors of the 2023-2025 methods (see the tests' names)."""
import pytest
import torch

import timm_tokcomp
from conftest import SMALL, make_model, thresholds
from test_families import family_model
from timm_tokcomp.rope import TokenPositions

DEPTH = SMALL["depth"]


def _prune_everything(depth):
    return thresholds(depth, merge=1.0, prune=1e6)  # importance / 1000 never reaches 1000: every slot fails


@pytest.mark.parametrize("name", ["avgpool_noclass", "cls"])
def test_ltmp_pruning_every_patch_keeps_one_per_image(name, images):
    model = timm_tokcomp.apply(make_model(name), "ltmp", threshold_params=_prune_everything(DEPTH))
    with torch.no_grad():
        logits = model(images)
    assert torch.isfinite(logits).all()
    stats = timm_tokcomp.last_stats(model)
    real = stats.size[:, model.num_prefix_tokens:, 0] > 0
    assert (real.sum(dim=1) >= 1).all()


@pytest.mark.parametrize("name", ["eva02_cat_swiglu", "siglip_map"])
def test_ltmp_pruning_every_patch_on_other_heads_stays_finite_and_per_image(name, images):
    overrides = dict(global_pool="avg") if name.startswith("eva") else {}
    model = family_model(name, **overrides)
    depth = len(model.blocks)
    model = timm_tokcomp.apply(model, "ltmp", threshold_params=_prune_everything(depth))
    with torch.no_grad():
        logits = model(images)
    assert torch.isfinite(logits).all()
    assert not torch.allclose(logits[0], logits[1])  # the images are still told apart


def _positions_seen(model, images):
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


# one method per plan kind that has destinations (a kept token, a merge's destination, a keeper, a group's lead)
DESTINATION_PLANS = {
    "MergePlan": ("tome", lambda depth: dict(r=3)),
    "KeepMergePlan": ("diffrate", lambda depth: dict(schedule={"prune": [16] + [12] * (depth - 1),
                                                                 "merge": [16] + [8] * (depth - 1)})),
    "GroupPlan": ("ltmp", lambda depth: dict(threshold_params=thresholds(depth, merge=0.0, prune=2.0))),
    "PrunePlan": ("topk", lambda depth: dict(r=3)),
}


@pytest.mark.parametrize("kind", sorted(DESTINATION_PLANS))
def test_every_plan_kind_carries_positions_under_both_rope_merge_choices(kind, images):
    """Under 'dst' every output token sits on the grid point of one of the patches it holds; under 'centroid' at the
    (size-weighted) centroid of what it holds; the two runs differ where something merged."""
    method, params = DESTINATION_PLANS[kind]
    out = {}
    for rope_merge in ("dst", "centroid"):
        model = family_model("eva02_cat_swiglu")
        model = timm_tokcomp.apply(model, method, trace_source=True, rope_merge=rope_merge,
                                   **params(len(model.blocks)))
        seen = _positions_seen(model, images)
        assert seen and {k for k, _, _ in seen} == {kind}
        stats = timm_tokcomp.last_stats(model)
        assert stats.rope_merge == rope_merge
        p = model.num_prefix_tokens
        grid, final = seen[0][1], seen[-1][2]
        source = stats.source[:, p:, p:]
        if rope_merge == "dst":
            held = (grid[:, None, :, :] == final[:, :, None, :]).all(-1) & (source > 0)
            assert held.any(-1).all()
        with torch.no_grad():
            out[rope_merge] = (final, model(images))
    if kind != "PrunePlan":  # a pruned token is its own destination and centroid: both choices agree
        assert not torch.equal(out["dst"][0], out["centroid"][0])
        assert not torch.equal(out["dst"][1], out["centroid"][1])
    else:
        assert torch.equal(out["dst"][1], out["centroid"][1])


def test_a_diffrate_schedule_reducing_in_block_0_is_refused():
    n = (SMALL["img_size"] // SMALL["patch_size"]) ** 2
    with pytest.raises(ValueError, match="reduce in block 0, which DiffRate never does; give this model's 64 patch"):
        timm_tokcomp.apply(make_model("cls"), "diffrate", schedule={"prune": [n - 8] * DEPTH, "merge": [n - 8] * DEPTH})
    timm_tokcomp.apply(make_model("cls"), "diffrate", schedule={"prune": [n] + [n - 8] * (DEPTH - 1),
                                                                "merge": [n] * DEPTH})


@pytest.mark.parametrize("method, params", [("diffrate", {}), ("ltmp", {}), ("dtem", dict(r=4))])
def test_in_place_training_steps_are_refused_on_rope_models_with_a_message(method, params, images):
    """DiffRate's search, LTMP and DTEM train with every token in place: on a rope model the forward says so, and
    `tokcomp finetune` refuses before it makes its run folder; their eval models run."""
    model = timm_tokcomp.apply(family_model("eva02_cat_swiglu"), method, **params)
    with pytest.raises(NotImplementedError, match="train it on a model without rotary embeddings"):
        model.train()(images)
    with torch.no_grad():
        assert torch.isfinite(model.eval()(images)).all()


def test_finetune_refuses_in_place_training_on_a_rope_model_before_its_folder(image_folder, tmp_path):
    from timm_tokcomp.training import FinetuneConfig, finetune

    out = tmp_path / "run"
    config = FinetuneConfig(method="dtem_r8", epochs=1, batch_size=4, distill=True, lora_rank=0)
    with pytest.raises(ValueError, match="dtem trains with every token in place .* Eva has rotary embeddings"):
        finetune("eva02_tiny_patch14_224", str(image_folder), str(out), config=config, show_progress=False,
                 num_workers=0)
    assert not out.exists()
