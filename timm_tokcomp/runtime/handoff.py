"""torch.compile(model) of a reduced model, handed to its compiled regions with the caller's compile. The reduced
forward, traced whole by dynamo (compiled_whole: not under torch.export or traced_whole()), calls forward_by_region
(one graph break, at the forward's start), which runs the regions (regions.compile_regions) compiled with the
backend, mode and options torch.compile was given; where that compile asks for Inductor's CUDA graphs (mode
'reduce-overhead' or 'max-autotune'), an inference forward of an image batch on the GPU is captured whole once per
input shape (graphs.GraphedByShape), as timm_tokcomp.compile(model, mode='cudagraph') captures it.

    fast = torch.compile(model, mode="reduce-overhead")   # model: reduced (reducing.ReducingModel)
    with torch.no_grad():
        logits = fast(images)                             # the regions, replayed from one CUDA graph per shape
"""
import contextlib
import warnings
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from .graphs import GraphedByShape
from .regions import compile_regions, running

NOT_READ_NOTE = (
    "torch.compile(model) on a model reduced by timm_tokcomp runs it compiled by regions (each region compiled once "
    "for every block, batch size and r); this torch did not say which backend and mode the call was given, so the "
    "regions compile with Inductor's defaults: for CUDA graphs call timm_tokcomp.compile(model, mode='cudagraph'), "
    "for another backend timm_tokcomp.compile(model, backend=...)")


_TRACED_WHOLE = False  # set by traced_whole(); dynamo reads it as a constant of the trace and guards on it


@contextlib.contextmanager
def traced_whole():
    """Within it (while torch.compile traces), a reduced model's forward is traced whole, as it is: one graph with a
    static count per block, what fullgraph=True, torch._dynamo.explain or an ahead-of-time compile need."""
    global _TRACED_WHOLE
    previous, _TRACED_WHOLE = _TRACED_WHOLE, True
    try:
        yield
    finally:
        _TRACED_WHOLE = previous


def compiled_whole(model: nn.Module) -> bool:
    """Whether torch.compile is tracing model's forward whole (torch.compile(model), model.compile()) where its
    method compiles by region: the forward then hands itself to its regions (forward_by_region). Never while
    exporting (torch.export traces the whole forward as it is) or within traced_whole()."""
    return (torch.compiler.is_compiling() and not _exporting() and not _TRACED_WHOLE
            and model._tokcomp.reducer.compiles_by_region)


def _exporting() -> bool:
    """Whether torch.export is tracing. Read from its flag: torch 2.11's dynamo answers torch.compiler.is_exporting()
    True in every trace (torch.compile's too); later versions read this flag (is_exporting() where it is gone)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else flag


class CallerCompile(NamedTuple):
    """What a torch.compile call was given, as its regions take it."""

    kwargs: Tuple[Tuple[str, Any], ...] = ()  # torch.compile's arguments for the regions (backend, options)
    cuda_graphs: bool = False  # Inductor's CUDA graphs asked for (mode 'reduce-overhead' or 'max-autotune')
    read: bool = True  # False: this torch's dynamo did not say (the regions compile with Inductor's defaults)


def caller_compile(compiler_fn: Any) -> CallerCompile:
    """The compile of dynamo's compiler_fn (torch.compile's backend as dynamo holds it, wrapped or not): Inductor's
    options with its CUDA graphs apart, or another backend with its mode and options."""
    for _ in range(8):  # dynamo wraps the backend a few times (its debug wrapper, torch.compile's)
        if isinstance(compiler_fn, getattr(torch, "_TorchCompileInductorWrapper", ())):
            options = dict(compiler_fn.config)
            cuda_graphs = bool(options.pop("triton.cudagraphs", False))
            return CallerCompile((("options", options),) if options else (), cuda_graphs)
        if isinstance(compiler_fn, getattr(torch, "_TorchCompileWrapper", ())):
            return CallerCompile((("backend", compiler_fn.compiler_fn), *sorted(compiler_fn.kwargs.items())))
        compiler_fn = getattr(compiler_fn, "_torchdynamo_orig_backend", None) or getattr(compiler_fn, "__wrapped__",
                                                                                          None)
    return CallerCompile(read=False)


_SEEN: List[CallerCompile] = []  # every compile a traced forward handed on, by index (the traced constant)


@torch._dynamo.assume_constant_result
def _tracing_compile() -> int:
    """The index in _SEEN of the torch.compile call tracing now: dynamo runs this while it traces the forward and
    keeps the result as a constant of the graph (each torch.compile call traces the forward on its own)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        caller = caller_compile(InstructionTranslator.current_tx().output.compiler_fn)
    except (ImportError, AttributeError):
        caller = CallerCompile(read=False)
    if caller not in _SEEN:
        _SEEN.append(caller)
    return _SEEN.index(caller)


class _HandedOn:
    """model's regions compiled as the caller's compile asks, and, where it asks for CUDA graphs, one graph per input
    shape for the inference forwards of image batches on the GPU (other forwards on the GPU run the regions, said
    once)."""

    def __init__(self, model: nn.Module, caller: CallerCompile) -> None:
        if not caller.read:
            warnings.warn(NOT_READ_NOTE, stacklevel=4)
        self.model = weakref.ref(model)  # alive at every call (the caller calls through it); _BY_MODEL keys it weakly
        self.regions = compile_regions(model, **dict(caller.kwargs))
        self.graphed = GraphedByShape(model, self._forward) if caller.cuda_graphs else None
        self._said_ungraphed = False

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model()
        with running(model, self.regions):
            return model.forward(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        on_gpu = any(torch.is_tensor(a) and a.is_cuda for a in (*args, *kwargs.values()))
        if self.graphed is not None and on_gpu:  # elsewhere no CUDA graphs, as Inductor's own skip them
            why = _why_not_graphed(self.model(), args, kwargs)
            if why is None:
                return self.graphed(_images(args, kwargs))  # the model's forward of those images, captured
            if not self._said_ungraphed:
                self._said_ungraphed = True
                warnings.warn(f"torch.compile(model) asked for CUDA graphs; this forward runs the compiled regions "
                              f"without them: {why}", stacklevel=4)
        return self._forward(*args, **kwargs)


def _images(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    """The image batch (B, 3, H, W) of a forward given it alone (its other arguments None: NaFlex's patch
    coordinates, transformers' options), positionally or by name, else None."""
    given = [value for value in (*args, *kwargs.values()) if value is not None]
    alone = len(given) == 1 and torch.is_tensor(given[0]) and given[0].dim() == 4
    return given[0] if alone and (not args or args[0] is given[0]) else None  # forward(images) does the same


def _why_not_graphed(model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[str]:
    """Why model(*args, **kwargs) cannot be replayed from a CUDA graph per input shape, or None where it can."""
    images = _images(args, kwargs)
    if images is None or not images.is_cuda:
        return "a CUDA graph per input shape replays forwards of an image batch on the GPU given alone"
    if model.training or torch.is_grad_enabled():
        return "a CUDA graph replays inference forwards (model.eval() and torch.no_grad() or torch.inference_mode())"
    if model._tokcomp.reducer.spec.data_dependent:
        return f"{model._tokcomp.reducer.name} reads its token counts from the data (a host wait per block)"
    return None


# model -> {the index of a compile in _SEEN: its regions}; nothing in it holds a reference to model
_BY_MODEL: "weakref.WeakKeyDictionary[nn.Module, Dict[int, _HandedOn]]" = weakref.WeakKeyDictionary()


def forward_by_region(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """model.forward(*args, **kwargs) run by its regions, compiled as the torch.compile tracing this call asks:
    what torch.compile(model) runs for a reduced model (called from its traced forward, compiled_whole)."""
    return _run_handed_on(model, _tracing_compile(), *args, **kwargs)


@torch.compiler.disable(reason="a model reduced by timm_tokcomp compiles by regions; for one whole graph "
                        "(fullgraph=True, torch._dynamo.explain) trace inside "
                        "timm_tokcomp.runtime.compile.traced_whole()")
def _run_handed_on(model: nn.Module, compile_index: int, *args: Any, **kwargs: Any) -> Any:
    """Outside the caller's trace: the regions of model for the compile _SEEN[compile_index], made on its first
    call."""
    handed_on = _BY_MODEL.setdefault(model, {})
    if compile_index not in handed_on:
        handed_on[compile_index] = _HandedOn(model, _SEEN[compile_index])
    return handed_on[compile_index](*args, **kwargs)
