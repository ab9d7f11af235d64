"""What torch.compile pays for a reduced model against its plain model, counted with torch's own counters: graphs,
graph breaks, recompiles for a second batch size and for a new r, Inductor's generated kernels, and the wall and
CPU seconds to the first output. Each row compiles in a fresh process with an empty Inductor cache, as a user's
first run does. The package's compiled modes (timm_tokcomp.runtime.compile) build each row.

    python scripts/compile_counts.py deit_tiny_patch16_224 --settings none tome_r16 evit_r16 --batches 2 4
    python scripts/compile_counts.py deit_tiny_patch16_224 --settings none tome_r16 --torch-compile  # as users do

Columns: graphs (unique graphs after the first batch), breaks, +batch and +r (graphs compiled again for the second
batch size / for set_params to the next r), kernels (Inductor kernels generated for the first batch), wall_s and
cpu_s (first batch, compile included), wall2_s (the second batch, compile included)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def one_row(model_name: str, setting: str, batches, new_r: int, whole: bool) -> dict:
    """Compile model_name with setting ('none': plain) in this process; the row of counts and times."""
    import timm
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    import timm_tokcomp
    from timm_tokcomp.runtime import compile as compiling

    torch.manual_seed(0)
    name = model_name if setting == "none" else f"{model_name}.{setting}"
    model = timm.create_model(name).eval()
    run = torch.compile(model) if whole else compiling.compile(model)
    form = "regions" if compiling.by_region(model) else "whole"
    row = {"model": model_name, "setting": setting, "compile": f"torch.compile(model): {form}" if whole else form}

    def graphs() -> int:
        return counters["stats"]["unique_graphs"]

    with torch.no_grad():
        x = torch.randn(batches[0], 3, *model.default_cfg["input_size"][1:])
        wall, cpu = time.perf_counter(), time.process_time()
        run(x)
        row.update(wall_s=round(time.perf_counter() - wall, 1), cpu_s=round(time.process_time() - cpu, 1),
                   graphs=graphs(), breaks=sum(counters["graph_break"].values()),
                   kernels=metrics.generated_kernel_count)
        before, wall = graphs(), time.perf_counter()
        run(x[:1].expand(batches[1], -1, -1, -1).contiguous())
        row.update({"+batch": graphs() - before, "wall2_s": round(time.perf_counter() - wall, 1)})
        if setting != "none" and new_r:
            before = graphs()
            timm_tokcomp.set_params(model, r=new_r)
            run(x)
            row["+r"] = graphs() - before
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--settings", nargs="+", default=["none", "tome_r16"])
    parser.add_argument("--batches", nargs=2, type=int, default=[2, 4])
    parser.add_argument("--new-r", type=int, default=8, help="r for set_params after the batches (0: skip)")
    parser.add_argument("--torch-compile", dest="whole", action="store_true",
                        help="compile each model as users do, torch.compile(model) (default mode and dynamism)")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: one setting, in a child process
    args = parser.parse_args()
    if args.row is not None:
        print(json.dumps(one_row(args.model, args.row, args.batches, args.new_r, args.whole)))
        return
    for setting in args.settings:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            cmd = [sys.executable, __file__, args.model, "--row", setting, "--new-r", str(args.new_r),
                   "--batches", *map(str, args.batches)] + (["--torch-compile"] if args.whole else [])
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{setting}: {done.stderr.strip().splitlines()[-1]}")
            print(done.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
