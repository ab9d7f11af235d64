"""`tokcomp speed`: the limit rows run the method's token schedule with no matching, and the table / CSV
report each method against plain and against its limit."""
import copy
import csv

import pytest
import timm
import torch

import timm_tokcomp
from timm_tokcomp.commands import speed
from timm_tokcomp.deployment import modes
from timm_tokcomp.cli import main
from timm_tokcomp.families import VIT
from timm_tokcomp.patch import patch
from timm_tokcomp.commands.speed import LimitReducer, limit_schedule
from timm_tokcomp.deployment.specs import parse_methods

FAST = ["--rounds", "1", "--no-progress"]


def _deit_tiny():
    torch.manual_seed(0)
    return timm.create_model("deit_tiny_patch16_224").eval()


def test_limit_runs_the_methods_token_schedule_by_dropping_tokens():
    x = torch.randn(2, 3, 224, 224)
    base = _deit_tiny()
    for method, params in (("tome", {"r": 16}), ("evit", {"r": 8}), ("atm", {})):
        model = timm_tokcomp.apply(copy.deepcopy(base), method, **params)
        kept = limit_schedule(model, x)
        limit = copy.deepcopy(base)
        patch(limit, LimitReducer(kept), VIT)
        with torch.no_grad():
            limit(x)
        assert timm_tokcomp.last_stats(limit).tokens_per_block == timm_tokcomp.last_stats(model).tokens_per_block
        assert timm_tokcomp.last_stats(limit).tokens_out == timm_tokcomp.last_stats(model).tokens_out


def test_limit_keeps_the_first_tokens_and_keeping_all_is_the_plain_model():
    x = torch.randn(2, 3, 224, 224)
    base = _deit_tiny()
    full = copy.deepcopy(base)
    patch(full, LimitReducer([197] * 12), VIT)
    with torch.no_grad():
        assert torch.equal(full(x), base(x))
        # keeping only the class token after block 0: the rest of the stack sees that one token
        one = copy.deepcopy(base)
        patch(one, LimitReducer([1] * 12))  # the family found by patch, as the shared GPU kit's limit calls it
        assert type(one).tokcomp_family is VIT
        h = base.norm_pre(base.patch_drop(base._pos_embed(base.patch_embed(x))))
        h = h + base.blocks[0].ls1(base.blocks[0].attn(base.blocks[0].norm1(h)))
        h = h[:, :1]
        h = h + base.blocks[0].ls2(base.blocks[0].mlp(base.blocks[0].norm2(h)))
        for blk in base.blocks[1:]:
            h = blk(h)
        torch.testing.assert_close(one(x), base.forward_head(base.norm(h)), rtol=1e-5, atol=1e-5)


def test_limit_reducer_refuses_bad_schedules():
    with pytest.raises(ValueError, match="kept"):
        LimitReducer([])
    with pytest.raises(ValueError, match="kept"):
        LimitReducer([4, 0])
    with pytest.raises(ValueError, match="one entry per block"):
        patch(_deit_tiny(), LimitReducer([100, 50]), VIT)
    with pytest.raises(TypeError, match="timm_tokcomp reduces tokens in timm's"):  # no family serves it
        patch(torch.nn.Linear(2, 2), LimitReducer([1]))


def test_speed_table_and_csv(tmp_path, capsys):
    out = tmp_path / "speed.csv"
    assert main(["speed", "test_vit", "--methods", "tome_r8,atm,dense_tome_r1,tome_r16@triton",
                 "--batches", "1,2",
                 "--out", str(out)] + FAST) == 0
    printed = capsys.readouterr().out
    assert "test_vit on CPU" in printed and "fp32 (no autocast)" in printed
    assert "tome_r8 limit" in printed and "batch 2" in printed
    rows = list(csv.DictReader(open(out)))
    assert [(r["batch"], r["method"]) for r in rows[:6]] == [
        ("1", "none"), ("1", "tome_r8"), ("1", "tome_r8 limit"), ("1", "atm"), ("1", "atm limit"),
        ("1", "dense_tome_r1")]
    by = {(r["batch"], r["method"]): r for r in rows}
    assert float(by["2", "none"]["vs_plain"]) == 1.0 and by["2", "none"]["vs_limit"] == ""
    assert float(by["2", "tome_r8"]["vs_limit"]) > 0 and by["2", "dense_tome_r1"]["vs_limit"] == ""
    assert {r["mode"] for r in rows} == {"eager"} and {r["dtype"] for r in rows} == {"fp32"}
    assert float(by["2", "tome_r16@triton"]["vs_limit"]) > 0  # ToMe's kernels (in the CPU interpreter here)


def test_speed_csv_keeps_the_batches_measured_before_a_run_stops(tmp_path, monkeypatch, capsys):
    """A run stopped in its second batch (a timeout, Ctrl-C) with --out F --overwrite leaves the user's F as it was
    and the first batch's rows, a whole CSV, in F.partial; a run that ends replaces F and removes F.partial."""
    out = tmp_path / "speed.csv"
    out.write_text("the user's earlier file\n")
    real, calls = speed.time_runs, []

    def stopping(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(speed, "time_runs", stopping)
    args = ["speed", "deit_tiny_patch16_224", "--methods", "tome_r8", "--batches", "1,2", "--out", str(out),
            "--overwrite"] + FAST
    assert main(args) == 130  # Ctrl-C: one line saying where the rows are
    assert f"tokcomp: interrupted; the rows measured so far are in {out}.partial" in capsys.readouterr().err
    assert out.read_text() == "the user's earlier file\n"
    rows = list(csv.DictReader(open(tmp_path / "speed.csv.partial")))
    assert [(r["batch"], r["method"]) for r in rows] == [("1", "none"), ("1", "tome_r8"), ("1", "tome_r8 limit")]
    monkeypatch.setattr(speed, "time_runs", real)
    assert main(args) == 0
    assert len(list(csv.DictReader(open(out)))) == 6 and not (tmp_path / "speed.csv.partial").exists()


def test_speed_compiled_mode_skips_data_dependent_methods_and_never_falls_back_silently(monkeypatch, capsys):
    # dynamo's capture with the 'eager' backend: the harness's wiring without inductor's minutes on a CPU
    monkeypatch.setattr(modes, "runner", lambda m, mode, x: torch.compile(m, backend="eager", dynamic=False))
    rows = speed.run_speed("deit_tiny_patch16_224", methods=parse_methods("tome_r8,tome_r16,evit_r8,atm,ats_k70"),
                           batches=[2], modes=["compile"], rounds=1, show_progress=False)
    assert [r.method for r in rows] == ["none", "tome_r8", "tome_r8 limit", "tome_r16", "tome_r16 limit",
                                        "evit_r8", "evit_r8 limit"]


def test_speed_compares_every_mode_with_the_fastest_plain_model_and_states_first_calls(monkeypatch):
    from timm_tokcomp.runtime import compile as compiling

    # the package's compiled mode (regions for the reduced models), traced by dynamo's 'eager' backend
    monkeypatch.setattr(modes, "runner", lambda m, mode, x: m if mode == "eager" else compiling.compile(m, backend="eager"))
    rows = speed.run_speed("deit_tiny_patch16_224", methods=parse_methods("tome_r16"), batches=[2], modes=["eager", "compile"],
                           rounds=2, show_progress=False)
    plain = {r.mode: r for r in rows if r.method == "none"}
    fastest = min(plain.values(), key=lambda r: r.ms)
    assert fastest.vs_fastest_plain == 1.0 and max(r.vs_fastest_plain for r in plain.values()) == 1.0
    for r in rows:
        assert r.vs_fastest_plain == pytest.approx(fastest.ms / r.ms) and r.first_s > 0
    printed = speed.format_speed(rows)
    assert f"against the fastest plain model (batch 2: {fastest.mode}, {fastest.ms:.1f}ms)" in printed
    assert "tome_r16 (compile)" in printed and "tome_r16 limit (compile)" not in printed


def test_speed_errors_name_the_flag(capsys):
    assert main(["speed", "deit_tiny_patch16_224", "--modes", "cudagraph"] + FAST) == 2
    assert "--modes cudagraph needs --device cuda" in capsys.readouterr().err
    assert main(["speed", "deit_tiny_patch16_224", "--modes", "eager,graph"] + FAST) == 2
    assert "--modes graph needs --device cuda" in capsys.readouterr().err
    assert main(["speed", "deit_tiny_patch16_224", "--modes", "jit"] + FAST) == 2
    assert "--modes" in capsys.readouterr().err
    assert main(["speed", "deit_tiny_patch16_224", "--batches", "0"] + FAST) == 2
    assert "--batches" in capsys.readouterr().err
    assert main(["speed", "deit_tiny_patch16_224", "--methods", "tome"] + FAST) == 2
    assert "--methods" in capsys.readouterr().err


def test_limit_of_a_study_method_reduces_where_the_method_does():
    """The study's methods reduce after the MLP of the block before each stage: so does their limit."""
    x = torch.randn(1, 3, 224, 224)
    model = timm.create_model("deit_tiny_patch16_224.topk_k70").eval()
    limit = _deit_tiny()
    patch(limit, LimitReducer(limit_schedule(model, x), after_mlp=True), VIT)
    with torch.no_grad():
        limit(x)
    assert timm_tokcomp.last_stats(limit).tokens_per_block == timm_tokcomp.last_stats(model).tokens_per_block
    assert timm_tokcomp.get_reducer(limit).reduces_at == "after_mlp"


def test_a_preset_that_declined_is_a_row_of_its_own_timed_as_plain(tmp_path, capsys):
    from timm_tokcomp.deployment.presets import write_preset

    preset = tmp_path / "declined.json"
    write_preset(preset, "none", {}, execution={"mode": "eager"})
    out = tmp_path / "speed.csv"
    assert main(["speed", "deit_tiny_patch16_224", "--methods", f"tome_r8,{preset}", "--batches", "1",
                 "--out", str(out)] + FAST) == 0
    rows = {r["method"]: r for r in csv.DictReader(open(out))}
    assert set(rows) == {"none", "tome_r8", "tome_r8 limit", str(preset)}
    assert rows[str(preset)]["vs_limit"] == "" and float(rows[str(preset)]["ms"]) > 0
