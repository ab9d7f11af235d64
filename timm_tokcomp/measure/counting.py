"""Counts from the run itself: multiply-accumulates and aten ops (with host syncs) of the ops that run (timing:
timm_tokcomp.measure.timing).

MACs are FLOPs / 2 as counted by `torch.utils.flop_counter.FlopCounterMode`, plus a formula for every fused
attention op that the installed torch dispatches to but has no formula for (torch >= 2.10 runs CPU
`F.scaled_dot_product_attention` as `aten._scaled_dot_product_flash_attention_for_cpu`, which FlopCounterMode
silently counts as 0; `nn.MultiheadAttention`'s inference fast path runs `aten._native_multi_head_attention`, its
projections included). A guard then checks every attention op that ran against its analytic count, so a
missing or doubled formula raises `AttentionCountError` instead of giving a wrong number.
"""
import threading
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# fused attention ops (forward) -> layout of their (query, key, value) arguments; "bhnd": (B, H, N, d),
# "bnhd": (B, N, H, d). The math path decomposes into bmm / matmul, which torch counts itself.
ATTENTION_LAYOUTS = {
    "_scaled_dot_product_flash_attention_for_cpu": "bhnd",
    "_scaled_dot_product_flash_attention": "bhnd",
    "_scaled_dot_product_efficient_attention": "bhnd",
    "_scaled_dot_product_cudnn_attention": "bhnd",
    "_scaled_dot_product_fused_attention_overrideable": "bhnd",
    "_flash_attention_forward": "bnhd",
    "_efficient_attention_forward": "bnhd",
}


class AttentionCountError(RuntimeError):
    """An attention op ran whose counted MACs differ from its analytic count (no formula, or a doubled one)."""


def attention_macs(layout: str, query_shape: Sequence[int], key_shape: Sequence[int],
                   value_shape: Sequence[int]) -> Optional[int]:
    """MACs of softmax(q kᵀ) v: B·Hq·N·M·(d + dv), QKᵀ and AV together. None for shapes that are not the
    dense 4-d layout (variable-length / nested inputs), whose count cannot be checked here."""
    if not (len(query_shape) == len(key_shape) == len(value_shape) == 4):
        return None
    if layout == "bhnd":
        (b, h, n, d), m, dv = query_shape, key_shape[2], value_shape[3]
    else:
        (b, n, h, d), m, dv = query_shape, key_shape[1], value_shape[3]
    return b * h * n * m * (d + dv)


# nn.MultiheadAttention's fused inference path (every real CLIP tower takes it): in-projection, attention and
# out-projection in one op, query (B, N, E), key / value (B, M, E)
FUSED_MHA = "_native_multi_head_attention"


def mha_macs(query_shape: Sequence[int], key_shape: Sequence[int]) -> Optional[int]:
    """MACs of a fused multi-head attention: q, k, v and out projections (E x E each) and softmax(q kᵀ) v over all
    heads, B·E·(2·N·E + 2·M·E + 2·N·M). None for shapes that are not (B, N, E)."""
    if not (len(query_shape) == len(key_shape) == 3):
        return None
    (b, n, e), m = query_shape, key_shape[1]
    return b * e * (2 * n * e + 2 * m * e + 2 * n * m)


def _op_name(packet) -> str:
    """'aten._scaled_dot_product_flash_attention_for_cpu' -> '_scaled_dot_product_flash_attention_for_cpu'."""
    return str(packet).split(".")[-1]


def _missing_formulas() -> Dict[object, Callable]:
    """FlopCounterMode formulas for the fused attention ops this torch has but counts nothing for."""
    formulas = {}
    for name, layout in ATTENTION_LAYOUTS.items():
        try:
            packet = getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):  # an op this torch does not have
            continue
        if packet in flop_counter.flop_registry:
            continue

        def flops(query, key, value, *args, _layout=layout, **kwargs) -> int:
            macs = attention_macs(_layout, query.shape, key.shape, value.shape)
            return 0 if macs is None else 2 * macs

        flops._get_raw = True  # receives tensors, on every torch (older ones never wrap custom formulas)
        formulas[packet] = flops
    packet = getattr(torch.ops.aten, FUSED_MHA, None)
    if packet is not None and packet not in flop_counter.flop_registry:
        def mha_flops(query, key, value, *args, **kwargs) -> int:
            macs = mha_macs(query.shape, key.shape)
            return 0 if macs is None else 2 * macs

        mha_flops._get_raw = True
        formulas[packet] = mha_flops
    return formulas


class _AttentionRecorder(TorchDispatchMode):
    """Records each attention op that runs (its overload packet and analytic MACs, None if uncheckable).

    Composite ops (which reach dispatch modes undecomposed under `torch.inference_mode`) are decomposed here,
    so the counter below sees the same backend ops (addmm, bmm, the fused attention kernel) on every torch
    and in every grad mode, and nothing is counted both as a composite op and as its parts."""

    supports_higher_order_operators = True  # FlexAttention passes through here: its MACs are counted analytically

    def __init__(self):
        super().__init__()
        self.calls: List[Tuple[object, Optional[int]]] = []
        self.flex_macs = 0  # FlexAttention's: its eager implementation runs with no mode on the stack

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            if func.name() != "flex_attention":
                raise NotImplementedError(f"MacCounter cannot count the higher-order operator {func.name()}")
            q, k, v = args[:3]  # (B, H, N, d) each
            self.flex_macs += attention_macs("bhnd", q.shape, k.shape, v.shape)
            with _disable_current_modes():  # its eager implementation refuses a dispatch mode on the stack
                return func(*args, **kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        name = _op_name(packet)
        if "attention" in name:
            layout = ATTENTION_LAYOUTS.get(name)
            macs = None
            tensors = len(args) >= 3 and all(isinstance(a, torch.Tensor) for a in args[:3])
            if layout is not None and tensors:
                macs = attention_macs(layout, args[0].shape, args[1].shape, args[2].shape)
            elif name == FUSED_MHA and tensors:
                macs = mha_macs(args[0].shape, args[1].shape)
            self.calls.append((packet, macs))
        return out


class _ThreadCounting(threading.local):
    """Per thread, as torch's dispatch-mode stack is: the callbacks (name, macs) of the counters open in this thread,
    told of every launch of the package's Triton kernels in this thread (dispatch modes never see a launch, and
    FlopCounterMode cannot count its multiply-accumulates), and how many launches are under way in it (> 0: the aten
    ops Triton's CPU interpreter runs then are not counted). Another thread's launches never reach these counters."""

    def __init__(self):
        self.listeners: List[Callable[[str, int], None]] = []
        self.launching = 0


_COUNTING = _ThreadCounting()


class _EagerFlexDirect:
    """While a counter is open, eager FlexAttention calls its higher-order operator directly (torch's debug switch)
    instead of through torch.compile, which refuses a dispatch mode on the stack: the same unfused computation,
    seen by the counter as one call. The switch is process-wide: counters open in any thread keep it until the last
    one closes (a lock keeps the count exact); meanwhile another thread's eager FlexAttention runs unfused too."""

    def __init__(self):
        self._depth, self._saved = 0, False
        self._lock = threading.Lock()

    def __enter__(self):
        import torch.nn.attention.flex_attention as flex

        with self._lock:
            if self._depth == 0:
                self._saved = flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
                flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
            self._depth += 1

    def __exit__(self, *exc):
        import torch.nn.attention.flex_attention as flex

        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = self._saved


_EAGER_FLEX_DIRECT = _EagerFlexDirect()


@contextmanager
def kernel_launch(name: str, macs: int):
    """Wrap each launch of one of the package's Triton kernels: open counters see one launch and its MACs."""
    _COUNTING.launching += 1
    try:
        yield
    finally:
        _COUNTING.launching -= 1
    for listener in _COUNTING.listeners:
        listener(name, macs)


class MacCounter:
    """Context manager counting the MACs of every op run inside it.

    with MacCounter() as c: model(x)
    then c.total is the MACs of everything that ran and c.by_module the MACs per module name. On exit it
    raises AttentionCountError, naming the op, when an attention op's count is not its analytic count.
    """

    def __init__(self):
        self._counter = flop_counter.FlopCounterMode(display=False, custom_mapping=_missing_formulas())
        self._recorder = _AttentionRecorder()
        self._kernel_macs = 0

    def _on_kernel(self, name: str, macs: int) -> None:
        self._kernel_macs += macs

    def __enter__(self) -> "MacCounter":
        _EAGER_FLEX_DIRECT.__enter__()
        self._counter.__enter__()
        self._recorder.__enter__()
        _COUNTING.listeners.append(self._on_kernel)
        return self

    def __exit__(self, *exc):
        _COUNTING.listeners.remove(self._on_kernel)
        self._recorder.__exit__(*exc)
        self._counter.__exit__(*exc)
        _EAGER_FLEX_DIRECT.__exit__(*exc)
        if exc[0] is None:
            self._check_attention()
        return False

    @property
    def total(self) -> float:
        """MACs of everything that ran, the package's Triton kernels included."""
        return self._counter.get_total_flops() / 2 + self._kernel_macs + self._recorder.flex_macs

    @property
    def by_module(self) -> Dict[str, float]:
        """MACs per module name as FlopCounterMode tracks them ('Global' is the total; the package's Triton
        kernels and FlexAttention count in 'Global' only)."""
        macs = {name: sum(ops.values()) / 2 for name, ops in self._counter.get_flop_counts().items()}
        macs["Global"] = self.total
        return macs

    def _check_attention(self) -> None:
        expected: Dict[object, int] = defaultdict(int)
        unchecked = set()  # ops with a call of a layout whose count cannot be derived here
        for packet, macs in self._recorder.calls:
            if macs is None:
                unchecked.add(packet)
            else:
                expected[packet] += macs
        counted = self._counter.get_flop_counts().get("Global", {})
        for packet, macs in expected.items():
            got = counted.get(packet, 0) / 2
            if packet not in unchecked and got != macs:
                raise AttentionCountError(
                    f"attention op {packet} ran, but FlopCounterMode counted {got:.0f} MACs for it where the analytic "
                    f"count is {macs} (torch {torch.__version__}): refusing to report a wrong MAC count")
        for packet in unchecked:
            if counted.get(packet, 0) == 0:
                raise AttentionCountError(
                    f"attention op {packet} ran, but FlopCounterMode has no formula for it on torch {torch.__version__}: "
                    "refusing to report a MAC count without its attention")


# aten ops that wait for the device: a Python scalar from a tensor, or an output shape that depends on data
# lift_fresh: a tensor built from Python data (torch.tensor) in the forward; on a GPU a blocking host-to-device copy
HOST_SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
                 "lift_fresh")


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run inside it (what the CPU dispatches and, for the non-view ones, a GPU launches),
    and the launches of the package's Triton kernels.

    with OpCounter() as ops: model(x)
    then ops.counts maps 'aten.<op>.<overload>', 'triton.<kernel>' and 'hop.<operator>' (a higher-order operator
    such as FlexAttention, counted as one call: what it runs inside is not counted) to calls, ops.total is their
    sum and ops.host_syncs the calls that make the host wait for the device (HOST_SYNC_OPS)."""

    supports_higher_order_operators = True  # FlexAttention's eager call passes through __torch_dispatch__

    def __init__(self):
        super().__init__()
        self.counts: Dict[str, int] = defaultdict(int)

    def _on_kernel(self, name: str, macs: int) -> None:
        self.counts[f"triton.{name}"] += 1

    def __enter__(self) -> "OpCounter":
        _EAGER_FLEX_DIRECT.__enter__()
        _COUNTING.listeners.append(self._on_kernel)
        return super().__enter__()

    def __exit__(self, *exc):
        _COUNTING.listeners.remove(self._on_kernel)
        try:
            return super().__exit__(*exc)
        finally:
            _EAGER_FLEX_DIRECT.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            self.counts[f"hop.{func.name()}"] += 1
            with _disable_current_modes():  # its eager implementation refuses a dispatch mode on the stack
                return func(*args, **(kwargs or {}))
        if not _COUNTING.launching:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def sync_counts(self) -> Dict[str, int]:
        """The calls of each op that makes the host wait for the device (HOST_SYNC_OPS), by op name."""
        return {op: n for op, n in self.counts.items() if op.startswith("aten.") and op.split(".")[1] in HOST_SYNC_OPS}

    @property
    def host_syncs(self) -> int:
        return sum(self.sync_counts.values())


@torch.no_grad()
def forward_counting(model: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, float]:
    """One forward of x: (B, 3, H, W) -> (output, multiply-accumulates it executed for the whole batch),
    counted from the ops actually run (see MacCounter)."""
    with MacCounter() as counter:
        out = model(x)
    return out, counter.total


def count_macs(model: nn.Module, x: torch.Tensor) -> float:
    """Multiply-accumulates executed by one forward of x: (B, 3, H, W), for the whole batch."""
    return forward_counting(model, x)[1]
