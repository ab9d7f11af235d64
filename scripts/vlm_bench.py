"""Time to first token and decode speed of a LLaVA with its visual tokens reduced, against the plain model and the
limit (the plain model given only K placeholder tokens and their features: no reduction work), side by side in one
run, random weights (docs/vlm.md, "Measured").

    python scripts/vlm_bench.py --text-layers 4 --rounds 3 --settings none,visionzip:108+36,visionzip:54+10,tome:12

The vision tower is LLaVA-1.5's (CLIP-L/336, read at layer -2, 'default': 576 image tokens); the language model has
Vicuna-7B's width and heads (4096 wide, 32 heads, MLP 11008, vocabulary 32064) and --text-layers of its 32 layers
(the whole 7B model in fp32 needs 28 GB). fp32: this CPU has no native bf16 (a 4096 x 4096 bf16 matmul runs at
0.2 GFLOPS here, fp32 at about 100). Per setting: image tokens into the language model, prefill MACs (vision plus
language model, counted from the ops run), the median time to first token (generate with one new token) with the
fastest and slowest round, decode tokens/s (16 more tokens), and whether the greedy tokens equal the plain model's.
"""
import argparse
import statistics
import time
from typing import Dict, List, Tuple

import torch

import timm_tokcomp
from timm_tokcomp.measure.counting import MacCounter

IMAGE, PAD = 32000, 32001


def build(text_layers: int) -> torch.nn.Module:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=text_layers,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, pad_token_id=PAD)
    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=336, patch_size=14, projection_dim=768)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE,
                                                      vision_feature_layer=-2,
                                                      vision_feature_select_strategy="default")).eval()
    model.set_attn_implementation("sdpa")
    model.generation_config.pad_token_id = PAD
    return model


def setting(text: str) -> Tuple[str, Dict[str, int]]:
    """'none', 'visionzip:D+C', 'tome:R' -> (method, params)."""
    method, _, arg = text.partition(":")
    if method == "visionzip":
        dominant, contextual = (int(v) for v in arg.split("+"))
        return method, dict(dominant=dominant, contextual=contextual)
    return (method, dict(r=int(arg))) if arg else (method, {})


def limit_inputs(model, ids: torch.Tensor, pixels: torch.Tensor, count: int):
    """The plain model's own features, the first `count` of them, behind `count` placeholders: what the language
    model would cost with K tokens and no reduction work (the tower still runs whole)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    keep = torch.ones_like(ids, dtype=torch.bool)
    start = int((ids[0] == IMAGE).nonzero()[0])
    keep[0, start + count:start + 576] = False

    def run(new_tokens: int):
        features = model.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
        encoded = BaseModelOutputWithPooling(pooler_output=[f[:count] for f in features])
        return model.generate(input_ids=ids[keep].view(1, -1), mm_encoder_outputs={"image": encoded},
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text-layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settings", default="none,visionzip:108+36,visionzip:54+10,tome:12")
    parser.add_argument("--decode", type=int, default=16, help="new tokens after the first, timed for tokens/s")
    args = parser.parse_args(argv)
    model = build(args.text_layers)
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.tensor([[1]]), torch.full((1, 576), IMAGE), torch.randint(2, 30000, (1, 32), generator=g)],
                    dim=1)  # an image and a 32-token prompt
    pixels = torch.randn(1, 3, 336, 336, generator=g)
    runs, counts, macs = {}, {}, {}
    for text in args.settings.split(","):
        method, params = setting(text)
        timm_tokcomp.remove(model)
        if method != "none":
            timm_tokcomp.apply(model, method, **params)
        counts[text] = timm_tokcomp.tokens_for(model, (336, 336)) if method != "none" else 576
        with torch.no_grad(), MacCounter() as counter:
            model(input_ids=ids, pixel_values=pixels)
        macs[text] = counter.total
        runs[text] = (method, params)
    k = min(counts.values())
    runs[f"limit K={k}"], counts[f"limit K={k}"] = ("limit", {}), k
    ttft: Dict[str, List[float]] = {name: [] for name in runs}
    decode: Dict[str, List[float]] = {name: [] for name in runs}
    tokens: Dict[str, torch.Tensor] = {}
    for _ in range(args.rounds):  # interleaved: each round times every setting once
        for name, (method, params) in runs.items():
            timm_tokcomp.remove(model)
            if method == "limit":
                run = limit_inputs(model, ids, pixels, k)
            else:
                if method != "none":
                    timm_tokcomp.apply(model, method, **params)

                def run(new_tokens, model=model):
                    return model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=new_tokens,
                                          min_new_tokens=new_tokens, do_sample=False)
            with torch.no_grad():
                t = time.perf_counter()
                run(1)
                first = time.perf_counter() - t
                t = time.perf_counter()
                out = run(1 + args.decode)
                whole = time.perf_counter() - t
            ttft[name].append(first)
            decode[name].append(args.decode / (whole - first) if whole > first else float("nan"))
            tokens[name] = out[0, -(1 + args.decode):]
    timm_tokcomp.remove(model)
    plain = statistics.median(ttft["none"]) if "none" in ttft else None
    print(f"LLaVA-1.5 vision (CLIP-L/336, layer -2) + {args.text_layers} Vicuna-7B-shaped layers, fp32, CPU, batch 1, "
          f"{ids.shape[1] - 576} text tokens, {args.rounds} rounds, random weights")
    print("| setting | image tokens | prefill GMACs | TTFT s (median [min, max]) | vs plain | decode tok/s | "
          "greedy = plain |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in runs:
        median = statistics.median(ttft[name])
        speed = f"{plain / median:.2f}x" if plain else "-"
        same = "-" if "none" not in tokens else ("yes" if torch.equal(tokens[name], tokens["none"]) else "no")
        gmacs = f"{macs[name] / 1e9:,.0f}" if name in macs else "-"
        print(f"| {name} | {counts[name]} | {gmacs} | {median:.2f} [{min(ttft[name]):.2f}, {max(ttft[name]):.2f}] | "
              f"{speed} | {statistics.median(decode[name]):.1f} | {same} |")


if __name__ == "__main__":
    main()
