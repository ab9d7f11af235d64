"""Compile every Triton kernel of the package to a cubin for one GPU architecture, in each dtype, without a GPU:
`python tests/tensors/compile_kernels_aot.py 90`. Run without TRITON_INTERPRET (interpreted kernels cannot be compiled).
Prints one line per kernel; exits non-zero on the first kernel the GPU compiler rejects."""
import itertools
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from timm_tokcomp.kernels import triton_dense, triton_evit, triton_tome


def kernels(dtype):
    ptr = "*" + dtype
    # the phases (norm, match, rank, lists) one program per image runs (ToMe, ATM's matching, ATM's plan), then
    # those of a launch per phase
    phases = ((True, True, True, True), (True, True, False, False), (False, False, True, True),
              (True, False, False, False), (False, True, False, False), (False, False, True, False),
              (False, False, False, True))
    for (norm, match, rank, lists), split in itertools.product(phases, (False, True)):
        pos = "*i64" if split else ptr  # a size-distinctive split's index lists, or the metric as placeholder
        yield (triton_tome._match_and_plan_kernel,
               {"METRIC": ptr, "NORMED": "*fp32" if norm or match else ptr, "WS": "*i32", "A_POS": pos, "B_POS": pos,
                "GROUPS": ptr, "threshold": "fp32"},
               {"NORM": norm, "MATCH": match, "RANK": rank, "LISTS": lists, "HAS_SPLIT": split, "GROUP_LISTS": False,
                "BLOCK": 32, "BLOCK_D": 64})
    for norm, match, rank, lists in (phases[0], phases[-1]):  # the dense variant's groups
        yield (triton_tome._match_and_plan_kernel,
               {"METRIC": ptr, "NORMED": "*fp32" if norm or match else ptr, "WS": "*i32", "A_POS": ptr, "B_POS": ptr,
                "GROUPS": "*i32", "threshold": "fp32"},
               {"NORM": norm, "MATCH": match, "RANK": rank, "LISTS": lists, "HAS_SPLIT": False, "GROUP_LISTS": True,
                "BLOCK": 32, "BLOCK_D": 64})
    for has_size in (True, False):
        for split in (True, False):
            pos = "*i64" if split else "*i32"
            yield (triton_tome._merge_kernel,
                   {"X": ptr, "SIZE": ptr, "WS": "*i32", "Y": ptr, "SIZE_OUT": ptr, "LOG_OUT": ptr, "A_POS": pos,
                    "B_POS": pos},
                   {"HAS_SIZE": has_size, "HAS_SPLIT": split, "BLOCK_C": 1024})
    evit_phases = [((True, True, True, True), bias) for bias in (True, False)]  # one program per image
    evit_phases += [(phase, bias) for phase in ((True, False, False, False), (False, True, False, False))
                    for bias in (True, False)] + [((False, False, True, False), False), ((False, False, False, True), False)]
    for (stats, attn, rank, lists), has_bias in evit_phases:
        yield (triton_evit._class_attention_plan_kernel, {"Q": ptr, "K": ptr, "BIAS": ptr, "WS": "*i32", "scale": "fp32"},
               {"STATS": stats, "ATTN": attn, "RANK": rank, "LISTS": lists, "HAS_BIAS": has_bias, "BLOCK": 64,
                "BLOCK_D": 64})
    for has_flag in (True, False):
        yield (triton_evit._prune_fuse_kernel, {"X": ptr, "SIZE": ptr, "WS": "*i32", "Y": ptr, "SIZE_OUT": ptr,
                                                "LOG_OUT": ptr},
               {"HAS_SIZE": has_flag, "BLOCK_C": 1024, "FUSE_ROWS": 8})
    for has_norm in (True, False):
        yield (triton_dense._merge_kernel, {"X": ptr, "Y": ptr, "W": ptr, "BIAS": ptr, "ORDER": "*i32",
                                            "OFFSETS": "*i32", "eps": "fp32"}, {"HAS_NORM": has_norm, "BLOCK_C": 1024})
    yield (triton_dense._unmerge_add_kernel, {"X": ptr, "Y": ptr, "GROUP": "*i32", "GAMMA": ptr, "OUT": ptr},
           {"HAS_GAMMA": True, "BLOCK_C": 1024})


def main(arch: int) -> None:
    target = GPUTarget("cuda", arch, 32)
    for dtype in ("fp32", "fp16", "bf16"):
        for fn, pointers, constexprs in kernels(dtype):
            signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in fn.arg_names}
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target)
            assert compiled.asm["cubin"], (fn.__name__, dtype)
            print(f"sm_{arch} {dtype} {fn.__name__} {constexprs}: cubin {len(compiled.asm['cubin'])} bytes, "
                  f"shared memory {compiled.metadata.shared} bytes")


if __name__ == "__main__":
    main(int(sys.argv[1]))
