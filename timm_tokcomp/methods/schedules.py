"""Per-block reduction budgets (how many tokens each block removes).

A schedule is resolved once per forward from the block count and the patch-token count, then each
block clamps its budget to what its tokens allow (never an error at run time).
"""
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from ..utils.checks import check_int, check_real, is_real

RSpec = Union[int, List[int], Tuple[int, float]]

# PYRA's (Xiong et al.) merge schedules for 12-block ViTs with 196 patches, by name (tags '<method>_low' / '_high')
NAMED_SCHEDULES = {
    "low": [16] * 11 + [10],
    "high": [40, 34, 30, 24, 18, 14, 10, 8, 4, 4, 3, 3],
}


def constant_schedule(r: int, num_blocks: int) -> List[int]:
    """r tokens per block: [r] * L."""
    return [r] * num_blocks


def inflection_schedule(r: int, inflection: float, num_blocks: int) -> List[int]:
    """Linear schedule with mean about r: inflection -1 starts at 2r and decreases to 0,
    0 is constant r, +1 starts at 0 and increases to 2r."""
    if num_blocks == 1:
        return [r]
    start = r * (1.0 - inflection)
    step = 2 * r * inflection / (num_blocks - 1)
    return [int(start + step * i) for i in range(num_blocks)]


def decreasing_schedule(num_blocks: int, num_patch: int, tokens_left: int, flops_ratio: float,
                        shape: Optional[float] = None) -> List[int]:
    """r_l = floor((g(l-1) - g(l)) * (T - t)), g(x) = (1 - x / L) ** (s - 1), for l = 1..L.

    T = num_patch, t = tokens_left, s = shape (default F/f = flops_ratio). Front-loads merging more as s grows.
    """
    L = num_blocks
    s = flops_ratio if shape is None else shape
    g = [(1.0 - x / L) ** (s - 1.0) for x in range(L + 1)]
    total = num_patch - tokens_left
    return [int(math.floor((g[l - 1] - g[l]) * total + 1e-9)) for l in range(1, L + 1)]


@dataclass(frozen=True)
class BlockCost:
    """MACs of one block as a function of its token counts (used only to solve FLOPs targets;
    reported MACs are always counted from the run)."""

    attn_linear: int  # MACs per token of the attention's linear layers (qkv, proj, ...)
    attn_dim: int  # heads * head_dim
    mlp_linear: int  # MACs per token of the MLP's linear layers

    def macs(self, n_attn: int, n_mlp: int) -> float:
        """n_attn tokens through attention, n_mlp tokens through the MLP."""
        return n_attn * self.attn_linear + 2 * n_attn * n_attn * self.attn_dim + n_mlp * self.mlp_linear


def schedule_macs(schedule: Sequence[int], num_tokens: int, num_prefix: int, cost: BlockCost) -> float:
    """Block-stack MACs of a schedule, with ToMe's per-block clamp."""
    total, n = 0.0, num_tokens
    for r in schedule:
        r = min(r, (n - num_prefix) // 2)
        total += cost.macs(n, n - r)
        n -= r
    return total


# front-loading shapes tried when the target's own shape cannot reach it (the same for every target, so a target
# is reachable whenever a stronger one is)
SHAPES = tuple(round(1.05 + 0.05 * i, 2) for i in range(400))


def solve_flops_schedule(
    flops_ratio: float, num_blocks: int, num_patch: int, num_prefix: int, cost: BlockCost
) -> List[int]:
    """The decreasing schedule with the most tokens left whose block MACs are at most 1 / flops_ratio
    of the unreduced blocks': of shape flops_ratio, or, where merging down to one token in that shape cannot reach
    it (the per-block clamp), of the least front-loaded shape in SHAPES that can. Raises ValueError when none can."""
    n = num_patch + num_prefix
    full = schedule_macs([0] * num_blocks, n, num_prefix, cost)
    budget = full / flops_ratio

    def reach(shape: float) -> float:
        return full / schedule_macs(decreasing_schedule(num_blocks, num_patch, 0, flops_ratio, shape), n, num_prefix,
                                    cost)

    shape = flops_ratio
    if reach(shape) < flops_ratio:
        shape = next((s for s in SHAPES if reach(s) >= flops_ratio), None)
        if shape is None:
            best = max(max(reach(s) for s in SHAPES), reach(flops_ratio))
            raise ValueError(f"flops_ratio={flops_ratio} is out of reach for this model; the most this schedule "
                             f"family reaches is about {best:.2f}")
    for tokens_left in range(num_patch, -1, -1):
        sched = decreasing_schedule(num_blocks, num_patch, tokens_left, flops_ratio, shape)
        if schedule_macs(sched, n, num_prefix, cost) <= budget:
            return sched
    raise AssertionError("unreachable: tokens_left = 0 reaches the target")


STUDY_STAGES = (4, 7, 10)  # 1-based blocks of the three reduction stages of "Which Tokens to Use?"


def check_keep_rate(keep_rate) -> float:
    """Validate a keep rate in (0, 1]."""
    return check_real("keep_rate", keep_rate, 0.0, high=1.0)


def check_stages(stages) -> Tuple[int, ...]:
    """Validate stages: a non-empty sequence of strictly increasing 1-based block numbers >= 2."""
    valid = isinstance(stages, (tuple, list)) and len(stages) > 0 \
        and all(not isinstance(b, bool) and isinstance(b, int) and b >= 2 for b in stages) \
        and all(b < c for b, c in zip(stages, stages[1:]))
    if not valid:
        raise ValueError(f"stages must be strictly increasing 1-based block numbers >= 2 (tokens are reduced "
                         f"before each, at the end of the block before it), got {stages!r}")
    return tuple(stages)


def stage_schedule(keep_rate: float, stages: Sequence[int], num_blocks: int, num_patch: int) -> List[int]:
    """The study's protocol as per-block r: the patch tokens entering block stages[s - 1] (1-based) are
    floor(num_patch * keep_rate ** s), so the block before it removes the rest (at its end); every other
    block removes none. E.g. keep_rate 0.7, 196 patches: 137, 96, 67 tokens from blocks 4, 7, 10 on."""
    if stages[-1] > num_blocks:
        raise ValueError(f"stages must be blocks 2..{num_blocks} of this model, got {tuple(stages)}")
    r, n = [0] * num_blocks, num_patch
    for s, block in enumerate(stages, 1):
        target = int(math.floor(num_patch * keep_rate ** s + 1e-9))
        r[block - 2], n = n - target, target
    return r


def resolve_r(r: RSpec, num_blocks: int) -> List[int]:
    """Turn an r spec (int, per-block list, or (r, inflection) tuple), as validate_r checked it, into a per-block
    list; only the list's length, which needs the model, is checked here."""
    if isinstance(r, tuple):
        return inflection_schedule(r[0], float(r[1]), num_blocks)
    if isinstance(r, list):
        if len(r) != num_blocks:
            raise ValueError(f"r as a per-block list needs one entry per block ({num_blocks}), got {len(r)}")
        return list(r)
    return constant_schedule(r, num_blocks)


def validate_r(r: RSpec, name: str = "r") -> RSpec:
    """Check an r spec's form without knowing the block count (a list's length is checked per forward); errors name
    it as `name` (the flag, on the command line).

    int: the same r in every block; list: one r per block; tuple (r, inflection): linear schedule.
    """
    if isinstance(r, tuple):
        if len(r) != 2 or not is_real(r[1]):
            raise ValueError(f"{name} as a tuple must be (r, inflection) with inflection in [-1, 1], got {r!r}")
        if not -1.0 <= r[1] <= 1.0:
            raise ValueError(f"{name} inflection must be in [-1, 1], got {r[1]}")
        return check_int(name, r[0]), float(r[1])
    if isinstance(r, list):
        return [check_int(f"{name}[{i}]", v) for i, v in enumerate(r)]
    return check_int(name, r)
