"""Calls of one reduced model from several threads at once: each call's output and last_stats are those of a
call made alone. Per-call state (token sizes, stats) must never leak from one concurrent call into another, as it
did when the head read the sizes of whichever call had last run the blocks."""
import threading

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import timm_tokcomp
from conftest import SMALL, reducing_params
from timm_tokcomp.methods import METHODS

# every method in METHODS (a new one included), each with a setting that reduces on the small model (64 patches + a
# class token, 4 blocks): its keep rate form where it has one (the study's three stages), else r, else the setting
# conftest.reducing_params gives it (its defaults, or the parameters it cannot do without: DyMU's thresholds)
SETTINGS = {name: {"keep_rate": 0.7, "stages": (2, 3, 4)} if "keep_rate" in cls.param_names()
            else {"r": 2 if cls.spec.dense else 4} if "r" in cls.param_names() \
            else reducing_params(name, SMALL["depth"])
            for name, cls in METHODS.items()}


def _avg_pooled(method, params):
    """The small model with avg pooling (which weighs each token by its size: the per-call state the head reads),
    reduced by method with params."""
    torch.manual_seed(0)
    return timm_tokcomp.apply(VisionTransformer(**{**SMALL, "global_pool": "avg"}).eval(), method, **params)


@pytest.mark.parametrize("method", SETTINGS)
def test_a_call_overtaken_by_another_thread_keeps_its_own_sizes(method):
    """Thread A stops after its blocks (in the final norm) until thread B has run a whole forward of the same model
    on other images; A's logits and last_stats are still its own."""
    model = _avg_pooled(method, SETTINGS[method])
    a, b = torch.randn(2, 3, 32, 32), torch.randn(2, 3, 32, 32) * 3
    with torch.no_grad():
        want_b = model(b)
        want_a = model(a)
        stats_a = timm_tokcomp.last_stats(model)
    b_done, a_in_norm = threading.Event(), threading.Event()
    got = {}

    def hold_a(module, args, output):
        if threading.current_thread().name == "A":
            a_in_norm.set()
            assert b_done.wait(timeout=30)

    def run(name, x):
        with torch.no_grad():
            got[name] = model(x)
            got[name + "_stats"] = timm_tokcomp.last_stats(model)
        if name == "B":
            b_done.set()

    handle = model.norm.register_forward_hook(hold_a)
    try:
        thread_a = threading.Thread(target=run, args=("A", a), name="A")
        thread_a.start()
        assert a_in_norm.wait(timeout=30)
        thread_b = threading.Thread(target=run, args=("B", b), name="B")
        thread_b.start()
        thread_b.join(timeout=30)
        thread_a.join(timeout=30)
    finally:
        handle.remove()
    torch.testing.assert_close(got["A"], want_a, rtol=0, atol=0)
    torch.testing.assert_close(got["B"], want_b, rtol=0, atol=0)
    if stats_a is not None:  # dense methods keep no stats
        assert got["A_stats"].tokens_per_block == stats_a.tokens_per_block
        if stats_a.size is not None:
            torch.testing.assert_close(got["A_stats"].size, stats_a.size, rtol=0, atol=0)


def test_many_concurrent_calls_each_return_their_own_result():
    """Two threads, 40 calls each on different images of one avg-pooled ToMe model: every result is the serial
    one (before the fix, some calls returned logits pooled with another call's sizes)."""
    model = _avg_pooled("tome", {"r": 4})
    inputs = [torch.randn(1, 3, 32, 32) * (1 + i % 5) for i in range(8)]
    with torch.no_grad():
        want = [model(x) for x in inputs]
    wrong = []

    def work(offset):
        with torch.no_grad():
            for step in range(40):
                i = (step + offset) % len(inputs)
                if not torch.equal(model(inputs[i]), want[i]):
                    wrong.append(i)

    threads = [threading.Thread(target=work, args=(k * 3,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert wrong == []


def test_graphed_forward_calls_from_threads_take_turns_on_its_buffers():
    """A CUDA graph replays on one input and one output buffer: concurrent calls must not interleave copy, replay
    and clone. A stand-in graph (the CPU has none) that yields between reading its input and writing its output
    shows an interleaving as a wrong result."""
    import time

    from timm_tokcomp.runtime.graphs import GraphedForward

    graphed = GraphedForward.__new__(GraphedForward)
    graphed._replaying = threading.Lock()
    graphed.static_input, graphed.static_output = torch.zeros(4), torch.zeros(4)

    class SlowGraph:
        def replay(self):
            value = graphed.static_input.clone()
            time.sleep(0.001)
            graphed.static_output.copy_(value * 2)

    graphed.graph = SlowGraph()
    wrong = []

    def work(value):
        for _ in range(30):
            out = graphed(torch.full((4,), float(value)))
            if not torch.equal(out, torch.full((4,), 2.0 * value)):
                wrong.append(value)

    threads = [threading.Thread(target=work, args=(v,)) for v in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert wrong == []
