"""A reduced model compiled the way users compile a timm model, torch.compile(model, mode=...), against the package's
own form timm_tokcomp.compile(model, mode=...) and the plain model under the same torch.compile, side by side in one
process: milliseconds per forward (medians of interleaved rounds), each against plain (the geometric mean of the
paired rounds' ratios and its 95 % interval, as tokcomp speed reports them), and seconds to the first
output (the two reduced forms share Inductor's cache in one process, so the second reads kernels the first compiled:
scripts/compile_counts.py times compiles in fresh processes). Modes: 'compile' (torch.compile's default mode) and, on
CUDA, 'cudagraph' (torch.compile's 'reduce-overhead'; the package's CUDA graph per input shape).

    python scripts/torch_compile_modes.py deit_base_patch16_224 --method tome_r16 --batches 32,256 --device cuda --amp
    python scripts/torch_compile_modes.py deit_tiny_patch16_224 --batches 2 --rounds 3   # the CPU: 'compile' only
"""
import argparse
import contextlib
import statistics
import sys
import time

import timm
import torch

import timm_tokcomp
from timm_tokcomp.utils.checks import check_int
from timm_tokcomp.cli.flags import numbers
from timm_tokcomp.runtime.compile import COMPILE_MODES
from timm_tokcomp.deployment.modes import check_batches
from timm_tokcomp.measure.stats import speedup_interval
from timm_tokcomp.measure.timing import no_silent_eager_fallback, synchronizer, time_runs


def first_output_s(fn, x) -> float:
    """Seconds to fn(x)'s first output (compile or capture included)."""
    sync = synchronizer(x)
    sync()
    start = time.perf_counter()
    fn(x)
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--method", default="tome_r16", help="a method tag (default: tome_r16)")
    parser.add_argument("--batches", default="32,256")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast (CUDA)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved timed rounds, >= 2 (default: 10)")
    args = parser.parse_args()
    try:
        batches = numbers("--batches", args.batches, int)
        check_batches(batches)
        check_int("--rounds", args.rounds, 2)
    except ValueError as error:
        sys.exit(f"error: {error}")
    modes = ["compile", "cudagraph"] if args.device.startswith("cuda") else ["compile"]
    amp = torch.autocast("cuda", torch.bfloat16) if args.amp else contextlib.nullcontext()
    print(f"{args.model} {args.method} on {torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}"
          f", torch {torch.__version__}, {'bf16 autocast' if args.amp else 'fp32'}")
    print("| mode | batch | form | ms | vs plain [95 % interval] | first output (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        for batch in batches:
            torch._dynamo.reset()
            plain = timm.create_model(args.model).to(args.device).eval()
            reduced = timm.create_model(f"{args.model}.{args.method}").to(args.device).eval()
            reduced.load_state_dict(plain.state_dict())
            kwargs = {"mode": COMPILE_MODES[mode]} if COMPILE_MODES[mode] else {}
            forms = {"plain, torch.compile": torch.compile(plain, dynamic=False, **kwargs),
                     "reduced, timm_tokcomp.compile": timm_tokcomp.compile(reduced, mode=mode),
                     "reduced, torch.compile": torch.compile(reduced, **kwargs)}
            x = torch.randn(batch, 3, *plain.default_cfg["input_size"][1:], device=args.device)
            with no_silent_eager_fallback(len(forms)), torch.inference_mode(), amp:
                first = {name: first_output_s(fn, x) for name, fn in forms.items()}
                times = time_runs(forms, x, rounds=args.rounds, warmup=2)
            base = times["plain, torch.compile"]
            for name, t in times.items():
                point, lo, hi = speedup_interval(base, t)
                print(f"| {mode} | {batch} | {name} | {statistics.median(t) * 1e3:.2f} | {point:.2f}x [{lo:.2f}, "
                      f"{hi:.2f}] | {first[name]:.1f} |")


if __name__ == "__main__":
    main()
