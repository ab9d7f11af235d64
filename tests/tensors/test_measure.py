"""MAC counting on the installed torch: plain DeiT-Tiny's known total with fused and manual attention, a ToMe
model with a size bias against its analytic total, and the guard that refuses a count missing (or doubling)
an attention op."""
import math

import pytest
import timm
import torch
from torch.utils import flop_counter

import timm_tokcomp
from timm_tokcomp.measure import counting as measure
from timm_tokcomp.measure.counting import AttentionCountError, MacCounter, attention_macs, count_macs

DEIT_TINY_GMACS = 1.2537  # measured with torch's own formulas where they covered SDPA (shared/NOTES.md)


def deit_tiny(fused: bool):
    model = timm.create_model("deit_tiny_patch16_224").eval()
    for blk in model.blocks:
        blk.attn.fused_attn = fused
    return model


@pytest.mark.parametrize("fused", [True, False])
def test_plain_deit_tiny_counts_its_known_total(fused):
    assert count_macs(deit_tiny(fused), torch.zeros(1, 3, 224, 224)) / 1e9 == pytest.approx(DEIT_TINY_GMACS, abs=5e-4)


def tome_analytic_macs(tokens_per_block, tokens_out, dim=192, head_dim=64, num_prefix=1, classes=1000):
    """DeiT-Tiny + ToMe per image: patch embedding, each block's qkv / QKᵀ / AV / proj on the tokens entering
    it, the matching scores (A x B on keys averaged over heads), the MLP on the tokens left, and the head."""
    total = 196 * (3 * 16 * 16) * dim + dim * classes
    after = list(tokens_per_block[1:]) + [tokens_out]
    for n, n_mlp in zip(tokens_per_block, after):
        patches = n - num_prefix
        total += n * 4 * dim * dim + 2 * n * n * dim  # qkv + proj, QKᵀ + AV
        if n_mlp < n:
            total += math.ceil(patches / 2) * (patches // 2) * head_dim  # matching scores
        total += n_mlp * 8 * dim * dim  # fc1 + fc2
    return total


@pytest.mark.parametrize("fused", [True, False])
def test_tome_with_size_bias_counts_its_analytic_total(fused):
    model = timm_tokcomp.apply(deit_tiny(fused), "tome", r=16)
    assert model._tokcomp.reducer.prop_attn is not False  # the log-size bias is passed to attention
    x = torch.randn(2, 3, 224, 224)
    macs = count_macs(model, x)
    stats = timm_tokcomp.last_stats(model)
    assert stats.tokens_per_block[1] < 197
    assert macs == 2 * tome_analytic_macs(stats.tokens_per_block, stats.tokens_out)
    assert macs / 2e9 == pytest.approx(0.621, abs=0.015)


def _remove_attention_formulas(monkeypatch):
    monkeypatch.setattr(measure, "_missing_formulas", lambda: {})
    for name in measure.ATTENTION_LAYOUTS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            monkeypatch.delitem(flop_counter.flop_registry, packet, raising=False)


def test_guard_fires_when_an_attention_formula_is_missing(monkeypatch):
    model = timm_tokcomp.apply(deit_tiny(True), "tome", r=8)
    _remove_attention_formulas(monkeypatch)
    with pytest.raises(AttentionCountError, match=r"attention op aten\._\w*attention\w* ran"):
        count_macs(model, torch.zeros(1, 3, 224, 224))


def test_guard_fires_when_attention_is_counted_twice(monkeypatch):
    doubled = {}
    for name, layout in measure.ATTENTION_LAYOUTS.items():
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue

        def flops(q, k, v, *args, _layout=layout, **kwargs):
            return 4 * attention_macs(_layout, q.shape, k.shape, v.shape)

        flops._get_raw = True
        doubled[packet] = flops
    _remove_attention_formulas(monkeypatch)
    monkeypatch.setattr(measure, "_missing_formulas", lambda: doubled)
    with pytest.raises(AttentionCountError, match="analytic count"):
        count_macs(deit_tiny(True), torch.zeros(1, 3, 224, 224))


def test_manual_attention_runs_no_attention_op_and_needs_no_formula(monkeypatch):
    _remove_attention_formulas(monkeypatch)
    assert count_macs(deit_tiny(False), torch.zeros(1, 3, 224, 224)) / 1e9 == pytest.approx(DEIT_TINY_GMACS, abs=5e-4)


@pytest.mark.parametrize("layout, q, k, v, macs", [
    ("bhnd", (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4), 2 * 3 * 5 * 7 * (8 + 4)),
    ("bnhd", (2, 5, 3, 8), (2, 7, 3, 8), (2, 7, 3, 4), 2 * 3 * 5 * 7 * (8 + 4)),
    ("bnhd", (10, 3, 8), (14, 3, 8), (14, 3, 8), None),  # variable-length (packed) inputs: not derivable
])
def test_attention_macs_layouts(layout, q, k, v, macs):
    assert attention_macs(layout, q, k, v) == macs


def test_counter_reports_per_module_and_errors_inside_pass_through():
    model = deit_tiny(True)
    with MacCounter() as counter:
        model(torch.zeros(1, 3, 224, 224))
    assert counter.by_module["Global"] == counter.total
    with pytest.raises(KeyError):
        with MacCounter():
            raise KeyError("from the forward")


@pytest.mark.parametrize("fused", [True, False])
def test_inference_mode_counts_the_same(fused):
    """Under inference_mode composite ops (linear, conv2d, scaled_dot_product_attention) reach the counter
    undecomposed; they must count as under no_grad."""
    model = timm_tokcomp.apply(deit_tiny(fused), "tome", r=8)
    x = torch.randn(2, 3, 224, 224)
    with MacCounter() as counter, torch.inference_mode():
        model(x)
    assert counter.total == count_macs(model, x)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_counters_count_flex_attention():
    """Eager FlexAttention runs through torch.compile, which refuses a dispatch mode: inside a counter it calls its
    higher-order operator directly (torch's debug switch, restored on exit). OpCounter counts it as one call (and
    host_syncs, the CUDA-graph capturability check, runs it: an H200 cudagraph run failed there); MacCounter
    counts its MACs as the mask's."""
    import torch.nn.attention.flex_attention as fa
    from conftest import make_model
    from timm_tokcomp.runtime.graphs import host_syncs
    from timm_tokcomp.measure.counting import OpCounter

    model = timm_tokcomp.apply(make_model("cls"), "tome", r=4, prop_attn="flex")
    mask = timm_tokcomp.apply(make_model("cls"), "tome", r=4, prop_attn="mask")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), OpCounter() as ops:
        with OpCounter():  # nested counters: the switch stays on until the outer one closes
            pass
        model(x)
    assert ops.counts["hop.flex_attention"] == len(model.blocks) - 1  # the first block has no sizes yet
    assert host_syncs(model, x) == {}
    assert count_macs(model, x) == count_macs(mask, x)
    assert fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG is False


def test_counters_in_threads_restore_the_flex_switch_when_the_last_closes():
    """Counters opened and closed by several threads while another thread holds one: the switch stays on while any is
    open and is restored (False) after the last closes, whichever thread closes it."""
    import threading

    import torch.nn.attention.flex_attention as fa
    from timm_tokcomp.measure.counting import OpCounter

    held, release = threading.Event(), threading.Event()
    seen = []

    def hold():
        with OpCounter():
            held.set()
            release.wait(20)

    def short():
        for _ in range(200):
            with OpCounter():
                seen.append(fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(20)
    shorts = [threading.Thread(target=short) for _ in range(3)]
    for t in shorts:
        t.start()
    for t in shorts:
        t.join(20)
    still_on = fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG  # the holder's counter is still open
    release.set()
    holder.join(20)
    assert len(seen) == 600 and all(seen) and still_on
    assert fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG is False


def test_a_thread_counting_triton_launches_never_changes_another_threads_count():
    """With the kernels in Triton's CPU interpreter, one thread counting a ToMe model on the Triton path while another
    counts the plain model: the second count is the plain model's alone every time, with no launch of the first's."""
    import threading

    from conftest import make_model
    from timm_tokcomp.measure.counting import OpCounter

    plain, reduced = make_model("cls").eval(), timm_tokcomp.apply(make_model("cls").eval(), "tome", r=4,
                                                                   kernel="triton")
    x = torch.randn(2, 3, 32, 32)

    def counts(model):
        with torch.no_grad(), OpCounter() as ops:
            model(x)
        return dict(ops.counts)

    alone, reduced_alone = counts(plain), counts(reduced)
    assert any(k.startswith("triton.") for k in reduced_alone)
    seen, errors, start = {"plain": [], "reduced": []}, [], threading.Barrier(2)

    def run(name, model):
        try:
            start.wait(20)
            for _ in range(3):
                seen[name].append(counts(model))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=a) for a in (("plain", plain), ("reduced", reduced))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert all(c == alone for c in seen["plain"]) and all(c == reduced_alone for c in seen["reduced"])
