"""`tokcomp methods`: every method, its tags, parameters and traits; the parameter glossary."""
import argparse
import textwrap


def add(sub: argparse._SubParsersAction) -> None:
    methods = sub.add_parser("methods", help="list the methods, their name tags and their parameters")
    methods.set_defaults(func=run, outputs=())


def run(args: argparse.Namespace) -> int:
    from ..methods import METHODS, listed_tags, parameter_table

    for name, cls in METHODS.items():
        print(name)
        print(textwrap.fill(", ".join(cls.tag_forms()) or "none", 110, initial_indent="  tags: ",
                            subsequent_indent="    "))
        if cls.tag_legend():
            print(textwrap.fill(cls.tag_legend(), 110, initial_indent="  legend: ", subsequent_indent="    "))
        print(textwrap.fill(", ".join(cls.param_names()), 110, initial_indent="  parameters: ",
                            subsequent_indent="    "))
        print(textwrap.fill(_traits(cls), 110, initial_indent="  traits: ", subsequent_indent="    "))
    print("parameters:")
    for param, default, help_, names in parameter_table():
        print(textwrap.fill(f"{help_} (default {default}; {names})", 110, initial_indent=f"  {param}: ",
                            subsequent_indent="    "))
    print(textwrap.fill("legend: <k>: r, the tokens each reducing block removes (tome_r16); <pct>: keep_rate in "
                        "percent, the share of tokens kept per reducing stage (evit_k70); low / high: the paper's "
                        "schedules. Method-specific forms are explained under their method.", 110,
                        subsequent_indent="  "))
    from ..families import served_classes

    print(textwrap.fill(f"models: the tags go on the names of timm's {served_classes()} architectures, after "
                        f"their pretrained tag (timm.list_models(pretrained=True) lists "
                        f"{', '.join(listed_tags())} on each), e.g. deit_small_patch16_224.fb_in1k.tome_r16, "
                        f"vit_base_patch16_siglip_224.v2_webli.tome_r16, vit_small_patch16_dinov3.lvd1689m.tome_r16, "
                        f"eva02_base_patch14_224.mim_in22k.tome_r8, vit_pe_core_base_patch16_224.fb.tome_r8, "
                        f"vit_base_patch16_rope_mixed_224.naver_in1k.tome_r8, naflexvit_base_patch16_siglip.v2_webli.tome_r16", 110,
                        subsequent_indent="  "))
    return 0


def _traits(cls) -> str:
    """What a method declares (TokenReducer's traits), in words."""
    traits = ["dense (keeps every token)"] if cls.spec.dense else []
    traits.append("token counts read from the data (eager only)" if cls.spec.data_dependent else "fixed token counts")
    traits.append("exports to ONNX" if cls.exportable() else f"no ONNX export ({cls.spec.export_refusal})")
    traits += ["fused Triton kernels (kernel=)"] if cls.has_kernel_choice() else []
    traits += ["ToCom compensators"] if cls.spec.tocom_compatible else []
    n = len(cls.spec.tune_space)
    traits += [f"in tune's default space ({n} setting{'' if n == 1 else 's'})"] if n else []
    return "; ".join(traits)
