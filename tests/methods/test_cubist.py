"""CubistMerge: the line step against a token-by-token reference, the grid staying a complete rectangular grid in
order, the max-magnitude combine, the merge's place, and the refusals."""
import pytest
import torch

import timm_tokcomp
from timm_tokcomp.methods.cubist import CubistMerge, CubistSetting, grid_merge, line_merge
from conftest import make_model


def _reference_line(line, r):
    """One line (W, C): odd positions choose their more similar even neighbour, the r best merge."""
    W = line.shape[0]
    cos = lambda i, j: float(torch.nn.functional.cosine_similarity(line[i], line[j], dim=0))  # noqa: E731
    choice = {}
    for s in range(1, W, 2):
        left, right = cos(s, s - 1), cos(s, s + 1) if s + 1 < W else float("-inf")
        choice[s] = (max(left, right), s + 1 if right > left else s - 1)
    merged = sorted(choice, key=lambda s: (-choice[s][0], s))[:r]
    kept = [t for t in range(W) if t not in merged]
    return [kept.index(choice[t][1]) if t in merged else kept.index(t) for t in range(W)]


@pytest.mark.parametrize("width, r", [(7, 2), (8, 4), (8, 1), (5, 2), (2, 1), (6, 0)])
def test_line_step_equals_a_token_by_token_reference(width, r):
    torch.manual_seed(width * 10 + r)
    tokens = torch.randn(2, 3, width, 6)
    got = line_merge(tokens, r)
    for b in range(2):
        for line in range(3):
            assert got[b, line].tolist() == _reference_line(tokens[b, line], r)


def test_the_grid_stays_rectangular_and_in_order_and_cells_keep_the_largest_magnitude():
    torch.manual_seed(0)
    rows, cols, p = 6, 5, 1
    tokens = torch.randn(2, p + rows * cols, 4)
    plan = grid_merge(tokens, CubistSetting(rows, cols, 2, 2), p)
    assert plan.num_groups == 4 * 3
    cell = plan.group.view(2, rows, cols)
    new_row, new_col = cell // 3, cell % 3
    assert (new_col.diff(dim=2) >= 0).all()  # order kept along every row
    for b in range(2):
        for c in range(3):  # and down every new column (rows merge different columns: new columns mix old ones)
            rows_down = [int(new_row[b, h][new_col[b, h] == c].min()) for h in range(rows)]
            assert rows_down == sorted(rows_down) and rows_down[0] == 0 and rows_down[-1] == 3
        assert sorted(set(cell[b].flatten().tolist())) == list(range(12))  # every cell of the smaller grid is filled
        assert all(len(set(new_col[b, h].tolist())) == 3 for h in range(rows))  # every row lost exactly 2
    x, size, _ = plan.apply(tokens, None, None)
    assert x.shape == (2, p + 12, 4) and torch.equal(x[:, :p], tokens[:, :p])
    for b in range(2):
        for g in range(12):
            members = tokens[b, p:][plan.group[b] == g]  # (m, C)
            expected = members.gather(0, members.abs().argmax(dim=0, keepdim=True))[0]
            assert torch.equal(x[b, p + g], expected)
            assert size[b, p + g, 0] == len(members)


def test_merges_once_at_the_input_of_its_layer(images):
    model = timm_tokcomp.apply(make_model("registers"), "cubist", r_rows=2, r_cols=3, layer=2, trace_source=True)
    with torch.no_grad():
        model(images)
    stats = timm_tokcomp.last_stats(model)
    assert stats.tokens_per_block == [68, 68, 4 + 6 * 5, 4 + 6 * 5]
    assert torch.equal(stats.source.sum(dim=1)[:, 4:], torch.ones(3, 64))  # every patch held once


def test_parameters_and_tags():
    assert timm_tokcomp.methods.parse_method_tag("cubist_r2") == ("cubist", {"r_rows": 2, "r_cols": 2})
    with pytest.raises(ValueError, match=r"layer must be a block of this model after the first, 1..3"):
        timm_tokcomp.apply(make_model("cls"), "cubist", layer=4)
    with pytest.raises(ValueError, match="layer must be an integer >= 1"):
        CubistMerge(layer=0)
    settings = CubistMerge(r_rows=9, r_cols=1).block_settings(4, 65, 1, None, grid=(8, 8))
    assert settings == [CubistSetting(8, 8, 4, 1), None, None, None]  # at most half of the rows
