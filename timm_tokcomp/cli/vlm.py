"""`tokcomp vlm`: a vision-language model's visual-token reduction against the plain model: tokens, prefill GMACs,
time to first token, decode speed and greedy-answer agreement (docs/vlm.md)."""
import argparse

from ..files.data import LIMIT
from ..utils.checks import comma_list, flag_type, int_list, integer
from .flags import device_flag, precision_flags, progress_flag

METHODS = "none,visionzip:dominant=108:contextual=36,visionzip:dominant=54:contextual=10"
ROUNDS = integer("--rounds", 1, high=1000)
DECODE = integer("--decode", 1, "(tokens)", high=4096)
ANSWER = integer("--answer-tokens", 1, "(tokens)", high=4096)
PROMPT_TOKENS = integer("--prompt-tokens", 1, "(tokens)", high=32768)
TEXT_LAYERS = integer("--text-layers", 1)
IMAGE_SIZE = int_list("--image-size", 1, "pixels", high=8192, most=2)


def add(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("vlm", help="a vision-language model's visual-token reduction against the plain model: "
                                    "tokens, prefill GMACs, time to first token, decode speed, answer agreement")
    sp.add_argument("folder", metavar="FOLDER", help="a transformers VLM saved with save_pretrained (LLaVA, LLaVA-NeXT, "
                                                    "Qwen2-VL, Qwen2.5-VL, Gemma 3, Idefics3, SmolVLM), loaded "
                                                    "offline")
    sp.add_argument("--methods", default=METHODS,
                    help="comma list of 'none' and METHOD:NAME=VALUE[:NAME=VALUE...]; the plain model is always "
                         "measured first; default: %(default)s")
    sp.add_argument("--random-weights", action="store_true",
                    help="build the model from config.json with random weights (no weights file read): the cost "
                         "of that configuration, answers meaningless")
    sp.add_argument("--text-layers", type=flag_type(TEXT_LAYERS),
                    help="only the language model's first N layers (a cost screen at a size that fits)")
    sp.add_argument("--data", help="folder of images: each method's greedy answer to --prompt against the plain "
                                   "model's (needs FOLDER's processor); the first image is also the one timed")
    sp.add_argument("--prompt", default="Describe the image in one sentence.", help="the question asked with --data")
    sp.add_argument("--limit", type=flag_type(LIMIT), help="only the first N images")
    sp.add_argument("--answer-tokens", type=flag_type(ANSWER), default=16,
                    help="greedy tokens compared per image (default: %(default)s)")
    sp.add_argument("--image-size", type=flag_type(IMAGE_SIZE, comma_list(int)),
                    help="H or H,W of the random image timed without --data, as the processor hands it over "
                         "(LLaVA-NeXT: the image's own size); default: the tower's size for LLaVA and Gemma 3, "
                         "672 for LLaVA-NeXT, 448 for Qwen2-VL, 1536,2048 for Idefics3 / SmolVLM")
    sp.add_argument("--prompt-tokens", type=flag_type(PROMPT_TOKENS), default=32,
                    help="random text tokens after the image without --data (default: %(default)s)")
    sp.add_argument("--rounds", type=flag_type(ROUNDS), default=3,
                    help="timed rounds, each timing every setting once, interleaved (default: %(default)s)")
    sp.add_argument("--decode", type=flag_type(DECODE), default=16,
                    help="tokens after the first, timed for decode tokens/s (default: %(default)s)")
    sp.add_argument("--no-limit", action="store_true",
                    help="leave out the limit row (the plain model given only the fewest kept tokens)")
    device_flag(sp)
    precision_flags(sp)
    progress_flag(sp)
    sp.set_defaults(func=run, outputs=())


def run(args: argparse.Namespace) -> int:
    import torch

    from .. import vlm
    from ..commands.vlm import (bench_vlm, format_rows, load_processor, load_vlm, parse_settings, placed,
                                processed, random_text)
    from ..files.data import open_images
    from ..measure.precision import describe_settings

    settings = parse_settings(args.methods)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    processor = load_processor(args.folder) if args.data else None
    model = load_vlm(args.folder, args.random_weights, args.text_layers, dtype, args.device)
    adapter = vlm.adapter_of(model)
    samples = []
    if args.data:
        images = open_images(args.data, lambda image: image, limit=args.limit)
        samples = [placed(processed(processor, images[i][0], args.prompt), args.device, dtype)
                   for i in range(len(images))]
        timing = samples[0]
        shape = "the first --data image"
    else:
        size = args.image_size or list(adapter.default_image_size(model))
        size = (size[0], size[-1])
        g = torch.Generator().manual_seed(0)
        timing = adapter.example_inputs(model, size, random_text(model, args.prompt_tokens, g), g)
        timing = placed(timing, args.device, dtype)
        shape = f"a random {size[0]} x {size[1]} image, {args.prompt_tokens} random text tokens"
    rows = bench_vlm(model, settings, timing, rounds=args.rounds, decode=args.decode, samples=samples,
                     answer_tokens=args.answer_tokens, with_limit=not args.no_limit,
                     show_progress=not args.no_progress)
    layers = model.config.text_config.num_hidden_layers
    print(f"{type(model).__name__} ({layers} language-model layers{', random weights' if args.random_weights else ''}"
          f"), {describe_settings(args.device, args.dtype, args.tf32)}, batch 1, {shape}, {args.rounds} rounds"
          + (f", answers: {len(samples)} images x {args.answer_tokens} greedy tokens" if samples else ""))
    print(format_rows(rows))
    if args.random_weights and samples:
        args.notes.append("--random-weights: the answers of random weights say nothing of a real model's")
    return 0
