"""What a GPU pays for, counted on any machine: aten ops per forward (all, and the non-view ones that launch a
kernel) and host syncs, on the first forward of a fresh model and on a later one, for one method on each
proportional-attention implementation (timm_tokcomp.measure.counting.OpCounter; random weights and inputs, fp32).

    python scripts/count_ops.py                                   # DeiT-Tiny, tome_r16, batch 8
    python scripts/count_ops.py --model deit_small_patch16_224 --methods tome_r8 --batch-size 2
    python scripts/count_ops.py --methods tome_r16,evit_r8,atm,dense_tome_r8 --prop-attn default
    python scripts/count_ops.py --hf-model path/to/folder --prop-attn default   # a transformers model folder
    python scripts/count_ops.py --model open_clip:ViT-B-32 --prop-attn default  # open_clip's tower (zero-shot head)
    python scripts/count_ops.py --model samvit_base_patch16_224 --methods cubist_r2 --prop-attn default

Eager FlexAttention runs through torch.compile, which refuses a dispatch mode; this script switches on torch's
debug path for it (the higher-order operator called directly), so its row counts the operator as one call and the
ops around it, not the fused kernel a compiled model runs."""
import argparse
import warnings

import timm
import torch

import timm_tokcomp
from timm_tokcomp.ops.attention import PROP_ATTN_IMPLS
from timm_tokcomp.measure.counting import OpCounter
from timm_tokcomp.deployment.specs import method_spec
from timm_tokcomp.models.build import HFFolder, build_base_model

VIEWS = {"view", "_unsafe_view", "reshape", "_reshape_alias", "permute", "transpose", "t", "expand", "unsqueeze",
         "squeeze", "select", "slice", "unbind", "split", "split_with_sizes", "alias", "as_strided", "detach",
         "unflatten", "flatten", "view_as", "narrow", "diagonal", "lift_fresh"}  # launch no kernel


def count(model: torch.nn.Module, x: torch.Tensor) -> str:
    with torch.no_grad(), OpCounter() as ops:
        model(x)
    launches = sum(n for op, n in ops.counts.items() if op.split(".")[1] not in VIEWS)
    syncs = ", ".join(f"{op} {n}" for op, n in ops.sync_counts.items())
    return f"{ops.total} ({launches}) | {ops.host_syncs}{f' ({syncs})' if syncs else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deit_tiny_patch16_224", help="a timm name or open_clip:ARCH")
    parser.add_argument("--hf-model", help="a transformers model folder (save_pretrained) instead of --model")
    parser.add_argument("--methods", default="tome_r16",
                        help="comma-separated method tags, as tokcomp bench --methods takes them")
    parser.add_argument("--prop-attn", default="all",
                        help="'all': a row per proportional-attention implementation; 'default': the method's own "
                             "setting (for methods without proportional attention, e.g. dense_tome_r8, atm)")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    import torch.nn.attention.flex_attention as flex

    flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    torch.manual_seed(0)

    def build() -> torch.nn.Module:  # the same random weights each time (the commands' seed)
        return build_base_model(HFFolder(args.hf_model) if args.hf_model else args.model, None, False, "cpu")

    plain = build()
    x = torch.randn(args.batch_size, *timm.data.resolve_model_data_config(plain)["input_size"])
    print(f"{args.hf_model or args.model}, batch {args.batch_size}, fp32, torch {torch.__version__}: "
          f"ops per forward (non-view ops that launch kernels) | host syncs")
    print("| method | prop_attn | first forward | syncs | later forward | syncs |\n"
          "| --- | --- | --- | --- | --- | --- |")
    print(f"| (plain model) | | {count(plain, x)} | {count(plain, x)} |")
    impls = PROP_ATTN_IMPLS if args.prop_attn == "all" else ("default",)
    for tag in args.methods.split(","):
        method, params = method_spec(tag)
        for impl in impls:
            kwargs = params if impl == "default" else {**params, "prop_attn": impl}
            model = timm_tokcomp.apply(build(), method, **kwargs)
            print(f"| {tag} | `{impl}` | {count(model, x)} | {count(model, x)} |")


if __name__ == "__main__":
    main()
