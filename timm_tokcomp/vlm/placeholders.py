"""The language model's side of a reduced image: each image's run of placeholder tokens (what the processor expanded
`<image>` into, one per visual token of the plain model) cut to the count of tokens the reduced encoder keeps, and
the rows padded again as they were padded. Positions stay contiguous (docs/vlm.md): the text after an image moves up
by the tokens it lost, as if the processor had written the shorter run, which is what a language model with 1-D
rotary positions was trained on."""
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch


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


def cut_runs(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], token: int, plain: int,
             counts: Sequence[int]) -> Cut:
    """The cut that shortens the i-th run of `token` (rows in order, runs in order: the images of the batch) from
    `plain` placeholders to counts[i]. ValueError naming what disagrees where the runs are not one of `plain`
    tokens per image."""
    B = input_ids.shape[0]
    keep = torch.ones_like(input_ids, dtype=torch.bool)
    image = 0
    for b in range(B):
        for start, length in image_runs(input_ids[b], token):
            if length != plain:
                raise ValueError(f"input_ids row {b} holds a run of {length} image placeholder tokens; the plain model "
                                 f"reads {plain} per image (prepare the inputs with the model's processor)")
            if image >= len(counts):
                raise ValueError(f"input_ids hold more image placeholder runs than the {len(counts)} images given")
            keep[b, start + counts[image]:start + length] = False
            image += 1
    if image != len(counts):
        raise ValueError(f"input_ids hold {image} image placeholder runs for {len(counts)} images; they must agree")
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    left = bool(attention_mask is not None and (~mask[:, 0]).any())
    kept_real = (keep & mask).sum(dim=1)
    length = int(kept_real.max())
    return Cut(keep & mask, length, left, length - kept_real)
