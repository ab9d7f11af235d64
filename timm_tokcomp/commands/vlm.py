"""`tokcomp vlm`: a vision-language model's visual-token reduction against the plain model, side by side in one
run: image tokens in and out, prefill MACs (vision plus language model, counted from the ops run), time to first
token and decode tokens/s over interleaved rounds with a 95 % interval, and, on a folder of images with a prompt,
how often each method's greedy answer is the plain model's (docs/vlm.md, "Measuring a VLM")."""
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from tqdm import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from .. import vlm
from ..files.bounded import read_json
from ..files.userfiles import check_declared_size, numel, safetensors_shapes, torch_file_shapes
from ..measure.counting import MacCounter
from ..measure.stats import rate_upper_bound, speedup_interval
from ..utils.checks import check_int, is_int

PLAIN = "none"


@dataclass(frozen=True)
class Setting:
    """One row: a method and its parameters, as `--methods` spells it ('none', 'visionzip:dominant=54:contextual=10',
    'tome:r=16')."""

    text: str
    method: str
    params: Dict[str, Any] = field(default_factory=dict)


def parse_settings(text: str) -> List[Setting]:
    """'none,METHOD:NAME=VALUE:...' -> the settings, the plain model first (added where it is not listed).
    A value is an int, else a float, else the string. ValueError naming --methods for a malformed entry."""
    settings = []
    for entry in (e.strip() for e in text.split(",")):
        method, *pairs = entry.split(":")
        if not method or any("=" not in p or not p.split("=", 1)[0] for p in pairs):
            raise ValueError(f"--methods: {entry!r} is not METHOD or METHOD:NAME=VALUE[:NAME=VALUE...] "
                             f"(e.g. none,visionzip:dominant=54:contextual=10,tome:r=16)")
        params = {}
        for pair in pairs:
            name, value = pair.split("=", 1)
            params[name] = _value(value)
        if method == PLAIN and params:
            raise ValueError(f"--methods: {entry!r}: 'none' (the plain model) takes no parameters")
        settings.append(Setting(entry, method, params))
    if len({s.text for s in settings}) != len(settings):
        raise ValueError(f"--methods {text!r} lists a setting twice")
    plain = [s for s in settings if s.method == PLAIN] or [Setting(PLAIN, PLAIN)]
    return plain + [s for s in settings if s.method != PLAIN]


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def declared_parameters(config: Any) -> int:
    """At least the parameters a VLM config describes: per sub-model (text_config, vision_config) layers x
    (4 width^2 + 2 width x MLP width), plus the text vocabulary's embeddings. ValueError naming the field for a
    size that is not a positive integer."""
    total = 0
    for part in ("text_config", "vision_config"):
        sub = getattr(config, part, None)
        if sub is None:
            continue
        layers = next((getattr(sub, n) for n in ("num_hidden_layers", "depth") if hasattr(sub, n)), None)
        width = next((getattr(sub, n) for n in ("hidden_size", "embed_dim") if hasattr(sub, n)), None)
        mlp = getattr(sub, "intermediate_size", None) or (4 * width if is_int(width) else None)
        for name, value in (("layers", layers), ("width", width), ("intermediate_size", mlp)):
            check_int(f"config.json's {part} {name}", value, 1)
        total += layers * (4 * width * width + 2 * width * mlp)
        vocab = getattr(sub, "vocab_size", 0) if part == "text_config" else 0
        total += vocab * width if is_int(vocab) and vocab > 0 else 0
    return total


def memory_bytes() -> int:
    """This machine's physical memory."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def load_vlm(folder: str, random_weights: bool = False, text_layers: Optional[int] = None,
             dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    """The VLM saved in folder (save_pretrained), loaded offline with sdpa attention in the class its config.json
    names (one of vlm.SERVED). random_weights: built from config.json alone (no weights file read: a cost
    measurement at that configuration); text_layers: only the language model's first N layers. The size its
    config declares is checked before anything is built: against the weights files, or against free memory."""
    import transformers

    path = Path(folder)
    names = read_json(path / "config.json", "FOLDER").get("architectures") or []
    if len(names) != 1 or names[0] not in vlm.SERVED:
        raise ValueError(f"FOLDER {folder}: its config.json names the architectures {names}; tokcomp vlm serves one "
                         f"of {', '.join(vlm.SERVED)}")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"FOLDER {folder}: config.json does not make a transformers config ({e})") from None
    if text_layers is not None:
        check_int("--text-layers", text_layers, 1, f"(the language model has {config.text_config.num_hidden_layers})",
                  high=config.text_config.num_hidden_layers)
        config.text_config.num_hidden_layers = text_layers
        if hasattr(config.text_config, "layer_types") and config.text_config.layer_types is not None:
            config.text_config.layer_types = config.text_config.layer_types[:text_layers]
    declared = declared_parameters(config)
    element = torch.finfo(dtype).bits // 8
    if random_weights:
        if declared * element > memory_bytes():
            raise ValueError(f"FOLDER {folder}: config.json describes at least {declared / 1e9:.1f}G parameters, "
                             f"{declared * element / 2 ** 30:.1f} GiB in {dtype}, more than this machine's "
                             f"{memory_bytes() / 2 ** 30:.1f} GiB of memory (--text-layers builds fewer layers)")
        torch.manual_seed(0)
        model = getattr(transformers, names[0])._from_config(config, attn_implementation="sdpa", dtype=dtype)
    else:
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
        if not files:
            raise ValueError(f"FOLDER {folder}: holds no weights file (*.safetensors or pytorch_model.bin); "
                             f"--random-weights measures the cost of its configuration without one")
        held = numel(shape for f in files for shape in (safetensors_shapes(f, "FOLDER") if f.suffix == ".safetensors"
                                                        else torch_file_shapes(f, "FOLDER")).values())
        if text_layers is None:
            check_declared_size(declared, held, f"a {names[0]}", path / "config.json",
                                f"its weights ({', '.join(f.name for f in files)})", "FOLDER",
                                slack=max(held // 4, 16_000_000))
        model = getattr(transformers, names[0]).from_pretrained(str(path), config=config, local_files_only=True,
                                                               attn_implementation="sdpa", dtype=dtype)
    model.eval().to(device)
    if getattr(model.generation_config, "pad_token_id", None) is None:
        model.generation_config.pad_token_id = getattr(config.text_config, "pad_token_id", None) or 0
    return model


def random_text(model: nn.Module, length: int, generator: torch.Generator) -> torch.Tensor:
    """(1, length) random ids of the text vocabulary, none of them a special token the config names (image,
    video, vision start / end, padding)."""
    config = model.config
    vocab = config.text_config.vocab_size
    special = {v for k, v in {**config.to_dict(), **config.text_config.to_dict()}.items()
               if k.endswith(("token_id", "token_index")) and is_int(v)}
    ids = torch.randint(0, vocab, (1, length), generator=generator)
    usable = next(i for i in range(vocab) if i not in special)
    return ids.masked_fill(torch.isin(ids, torch.tensor(sorted(special) or [-1])), usable)


@dataclass
class Row:
    """One setting's measurements; None where it was not measured."""

    setting: str
    tokens_in: int
    tokens_out: Optional[int] = None
    gmacs: Optional[float] = None
    ttft: List[float] = field(default_factory=list)
    decode: List[float] = field(default_factory=list)
    agree: Optional[int] = None
    answered: int = 0


def first_token_cost(model: nn.Module, run: Callable[..., Any], inputs: Dict[str, torch.Tensor]) -> Tuple[int, float]:
    """(the sequence length the language model prefills, MACs up to the first token: vision, the projector and
    the prefill) of run (a generator_of) on one sample."""
    seen = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda m, a, k: seen.append((k.get("inputs_embeds") if k.get("inputs_embeds") is not None else a[0]).shape[1]),
        with_kwargs=True)
    try:
        with MacCounter() as counter:
            greedy(run, inputs, 1)
    finally:
        hook.remove()
    return seen[0], counter.total


class Stamps(StoppingCriteria):
    """A stopping criterion that stops nothing and notes the time each new token is there."""

    def __init__(self) -> None:
        self.times: List[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def timed(run: Callable[..., Any], inputs: Dict[str, torch.Tensor], new_tokens: int) -> Tuple[float, float]:
    """(seconds to the first token, decode tokens/s over the new_tokens after it) of one greedy generate."""
    stamps = Stamps()
    with torch.no_grad():
        start = time.perf_counter()
        run(inputs, max_new_tokens=1 + new_tokens, min_new_tokens=1 + new_tokens, do_sample=False,
            stopping_criteria=StoppingCriteriaList([stamps]))
    first, last = stamps.times[0], stamps.times[-1]
    return first - start, new_tokens / (last - first)


def generator_of(model: nn.Module, setting: Setting, limit: Optional[int]) -> Callable[..., Any]:
    """generate(inputs, **kwargs) of this setting: the plain model, the model reduced by the setting (applied now:
    the caller removes it), or the limit (the plain model given `limit` placeholder tokens, no reduction work)."""
    vlm.remove(model)
    if setting.method == "limit":
        adapter = vlm.adapter_of(model)
        return lambda inputs, **kw: adapter.limit_generate(model, inputs, limit, **kw)
    if setting.method != PLAIN:
        vlm.apply(model, setting.method, **setting.params)
    return lambda inputs, **kw: model.generate(**inputs, **kw)


def load_processor(folder: str) -> Any:
    """The folder's processor (tokenizer, image processor, chat template), loaded offline; ValueError naming
    --data where it has none."""
    import transformers

    try:
        return transformers.AutoProcessor.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"--data: answering needs FOLDER {folder}'s processor (its tokenizer and image processor, "
                         f"saved beside the model), and it does not load ({type(e).__name__}: "
                         f"{str(e).strip()[:300]})") from None


def processed(processor: Any, image: Any, prompt: str) -> Dict[str, torch.Tensor]:
    """The model's inputs for one image and a prompt, as a user of the processor builds them: the chat template
    where it has one (the image, then the prompt, then the assistant's turn), else its image token and the
    prompt."""
    if getattr(processor, "chat_template", None):
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                          {"type": "text", "text": prompt}]}],
                                             add_generation_prompt=True)
    else:
        text = f"{processor.image_token}\n{prompt}"
    return dict(processor(images=[image], text=[text], return_tensors="pt"))


def placed(inputs: Dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """inputs on device, their floating-point tensors (the pixels) in the model's dtype."""
    return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in inputs.items()}


def greedy(run: Callable[..., Any], inputs: Dict[str, torch.Tensor], new_tokens: int) -> torch.Tensor:
    """The `new_tokens` greedy tokens (T,) after the prompt of one sample."""
    with torch.no_grad():
        out = run(inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:]


def bench_vlm(model: nn.Module, settings: Sequence[Setting], timing_inputs: Dict[str, torch.Tensor],
              rounds: int = 3, decode: int = 16,
              samples: Sequence[Dict[str, torch.Tensor]] = (), answer_tokens: int = 16, with_limit: bool = True,
              show_progress: bool = True) -> List[Row]:
    """The rows of settings (the plain model first) on one VLM: counts and MACs on timing_inputs (one image), then
    `rounds` interleaved rounds, each timing every setting's time to first token and `decode` more tokens in one
    greedy generate; then each setting's greedy answer of answer_tokens on every sample against the plain model's.
    with_limit adds the limit row at the fewest tokens kept, where the adapter has one."""
    adapter = vlm.adapter_of(model)
    vlm.remove(model)
    plain_count = int((timing_inputs["input_ids"] == model.config.image_token_id).sum())
    runs, rows, plain_length = {}, {}, None
    for setting in settings:
        length, macs = first_token_cost(model, generator_of(model, setting, None), timing_inputs)
        plain_length = length if plain_length is None else plain_length
        rows[setting.text] = Row(setting.text, plain_count, plain_count - (plain_length - length), macs / 1e9)
        runs[setting.text] = setting
    fewest = min(r.tokens_out for r in rows.values())
    if with_limit and hasattr(adapter, "limit_generate") and fewest < plain_count:
        limit = Setting(f"limit K={fewest}", "limit")
        _, macs = first_token_cost(model, generator_of(model, limit, fewest), timing_inputs)
        rows[limit.text], runs[limit.text] = Row(limit.text, plain_count, fewest, macs / 1e9), limit
    total = rounds * len(runs) + (len(samples) * len(runs) if samples else 0)
    with tqdm(total=total, desc="vlm", disable=not show_progress, file=sys.stderr) as bar:
        for _ in range(rounds):  # interleaved: each round times every setting once
            for name, setting in runs.items():
                first, speed = timed(generator_of(model, setting, fewest), timing_inputs, decode)
                rows[name].ttft.append(first)
                rows[name].decode.append(speed)
                bar.update()
        if samples:
            answers: Dict[str, List[torch.Tensor]] = {}
            for name, setting in runs.items():
                run = generator_of(model, setting, fewest)
                answers[name] = [greedy(run, sample, answer_tokens) for sample in samples]
                bar.update(len(samples))
            for name, row in rows.items():
                row.answered = len(samples)
                row.agree = sum(torch.equal(a, b) for a, b in zip(answers[name], answers[PLAIN]))
    vlm.remove(model)
    return list(rows.values())


def format_rows(rows: Sequence[Row]) -> str:
    """The rows as a markdown table; the speed-up of each against the plain model (first row) with its 95 %
    interval over the paired rounds, agreement with its 95 % lower bound (Clopper-Pearson)."""
    plain = rows[0]
    lines = ["| setting | image tokens in -> out | prefill GMACs | TTFT s median [min, max] | TTFT speed-up [95 % CI] "
             "| decode tok/s | greedy answer = plain |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        gmacs = "-" if row.gmacs is None else f"{row.gmacs:,.0f}" if row.gmacs >= 100 else f"{row.gmacs:.3g}"
        if row.ttft:
            ttft = f"{statistics.median(row.ttft):.2f} [{min(row.ttft):.2f}, {max(row.ttft):.2f}]"
            est, lo, hi = speedup_interval(plain.ttft, row.ttft)
            speed = f"{est:.2f}x [{lo:.2f}, {hi:.2f}]" if hi != float("inf") else f"{est:.2f}x"
            decode = f"{statistics.median(row.decode):.1f}"
        else:
            ttft = speed = decode = "-"
        if row.agree is None:
            agree = "-"
        else:
            low = 1 - rate_upper_bound(row.answered - row.agree, row.answered)
            agree = f"{row.agree}/{row.answered} (>= {100 * low:.0f} %)"
        lines.append(f"| {row.setting} | {row.tokens_in} -> {row.tokens_out} | {gmacs} | {ttft} | {speed} | {decode} | "
                     f"{agree} |")
    return "\n".join(lines)


__all__ = ["Row", "Setting", "bench_vlm", "declared_parameters", "format_rows", "load_processor", "load_vlm",
           "parse_settings", "placed", "processed", "random_text"]
