"""The language model's side of a reduced image: each image's run of placeholder tokens (what the processor expanded
`<image>` into, one per visual token of the plain model) cut to the tokens the reduced encoder keeps, and the rows
padded again as they were padded. What the positions become is the adapter's rule (docs/vlm.md): LLaVA renumbers
them contiguously; Qwen2-VL cuts its M-RoPE ids with the same Cut, so kept tokens keep theirs."""
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from transformers.utils import ModelOutput


@dataclass
class Cut:
    """Where the rows' tokens went: keep (B, N) which tokens of the original rows stay; the new rows' length L and
    padding side; pad_left (B,) the padding each new row starts with (left padding, else 0)."""

    keep: torch.Tensor
    length: int
    left: bool
    pad_left: torch.Tensor

    def apply(self, t: torch.Tensor, pad: int) -> torch.Tensor:
        """(B, N, ...) rows of the original sequence -> (B, L, ...) the kept tokens, padded with `pad`."""
        out = t.new_full((t.shape[0], self.length, *t.shape[2:]), pad)
        for b in range(t.shape[0]):
            kept = t[b, self.keep[b]]
            start = int(self.pad_left[b]) if self.left else 0
            out[b, start:start + kept.shape[0]] = kept
        return out


def image_runs(row: torch.Tensor, token: int) -> List[Tuple[int, int]]:
    """(start, length) of each run of `token` in a 1-D row of ids, in order."""
    hit = torch.cat([row.new_zeros(1), (row == token).to(torch.int8), row.new_zeros(1)])
    edges = (hit[1:] - hit[:-1]).nonzero().flatten().tolist()
    return [(edges[i], edges[i + 1] - edges[i]) for i in range(0, len(edges), 2)]


def cut_runs(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], token: int,
             plain: Union[int, Sequence[int]], kept: Sequence[Union[int, torch.Tensor]]) -> Cut:
    """The cut that shortens the i-th run of `token` (rows in order, runs in order: the images of the batch) from
    plain (one count, or one per image) placeholders to kept[i]: a count (the run's first ones stay) or a 1-D index
    tensor of the placeholders that stay. ValueError naming what disagrees where the runs do not match the images."""
    B = input_ids.shape[0]
    plains = [plain] * len(kept) if isinstance(plain, int) else list(plain)
    keep = torch.ones_like(input_ids, dtype=torch.bool)
    image = 0
    for b in range(B):
        for start, length in image_runs(input_ids[b], token):
            if image >= len(kept):
                raise ValueError(f"input_ids hold more image placeholder runs than the {len(kept)} images given")
            if length != plains[image]:
                raise ValueError(f"input_ids row {b} holds a run of {length} image placeholder tokens; the plain model "
                                 f"reads {plains[image]} for that image (prepare the inputs with the model's "
                                 f"processor)")
            stays = kept[image]
            if isinstance(stays, int):
                keep[b, start + stays:start + length] = False
            else:
                run = torch.zeros(length, dtype=torch.bool, device=keep.device)
                run[stays.to(keep.device)] = True
                keep[b, start:start + length] = run
            image += 1
    if image != len(kept):
        raise ValueError(f"input_ids hold {image} image placeholder runs for {len(kept)} images; they must agree")
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    left = bool(attention_mask is not None and (~mask[:, 0]).any())
    kept_real = (keep & mask).sum(dim=1)
    length = int(kept_real.max())
    return Cut(keep & mask, length, left, length - kept_real)


def with_prompt(out: Any, input_ids: torch.Tensor, short: int) -> Any:
    """generate's output (sequences (B, short + T), or a ModelOutput holding them) with the cut prompt replaced by
    the given input_ids (B, N): (B, N + T), as the plain model returns them."""
    sequences = out.sequences if isinstance(out, ModelOutput) else out
    restored = torch.cat([input_ids, sequences[:, short:]], dim=1)
    if isinstance(out, ModelOutput):
        out.sequences = restored
        return out
    return restored
