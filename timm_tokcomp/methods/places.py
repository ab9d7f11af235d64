"""Where in its block a reducing block reduces (TokenReducer.place, or its reduces_at where parameters decide)."""
from enum import Enum


class ReducesAt(str, Enum):
    """AFTER_ATTENTION: between attention and MLP; AFTER_MLP: at the end of the block (the study protocol's place);
    BEFORE_ATTENTION: at its start, with lookahead(), from this block's attention probabilities at the unreduced
    count, which are then merged and reused (MCTF). A str, so it compares equal to its value ("after_mlp")."""

    AFTER_ATTENTION = "after_attention"
    AFTER_MLP = "after_mlp"
    BEFORE_ATTENTION = "before_attention"
