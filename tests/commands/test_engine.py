"""The training engine on a small task: resume is bit-identical, accumulation equals one large batch, AMP runs
(bf16 autocast on the CPU; fp16 refused there), divergence saves nothing non-finite, old checkpoints are refused
naming the version, and a changed recipe is refused on resume."""
from pathlib import Path

import pytest
import torch
from torch import nn

from timm_tokcomp.training.engine import (CHECKPOINT_FORMAT, Schedule, SeededAugment, TrainingDiverged, TrainingTask,
                                          rank_share, train)


class Regression(TrainingTask):
    """Least squares of a linear layer on 24 fixed random points; evaluates its mean error every epoch."""

    name = "regression"
    log_columns = ("loss", "norm")

    def __init__(self, device: str, world: int, lr: float = 0.05, batch_size: int = 4, accumulate: int = 1,
                 amp=None, amp_dtype: str = "bfloat16", steps: int = 12) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(24, 8, generator=g), torch.randn(24, 2, generator=g)
        self.train_set = SeededAugment(torch.utils.data.TensorDataset(self.x, self.y), seed=0)
        self.module = nn.Linear(8, 2)
        per_step = batch_size * world * accumulate
        self.schedule = Schedule(steps=steps, steps_per_epoch=24 // per_step, batch_size=batch_size, lr=lr,
                                 weight_decay=0.0, warmup_steps=2, seed=0, checkpoint_every=2, accumulate=accumulate,
                                 amp=amp, amp_dtype=amp_dtype)
        self.dtypes = set()

    def loss(self, batch, step):
        x, y = batch
        out = self.forward(x)
        self.dtypes.add(out.dtype)
        return {"loss": ((out.float() - y) ** 2).mean(), "norm": self.module.weight.norm().item()}

    def evaluate(self, epoch):
        with torch.no_grad():
            return {"error": ((self.module(self.x) - self.y) ** 2).mean().item()}

    def finish(self, out, writer, seconds):
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def interrupted(self):
        return "stopped"


def _train(out: Path, task_args=None, **kwargs):
    tasks = []
    task_args = task_args or {}

    def make(device, world):
        tasks.append(Regression(device, world, **task_args))
        return tasks[-1]

    settings = {key: task_args.get(key, default) for key, default in
                (("lr", 0.05), ("batch_size", 4), ("accumulate", 1), ("amp", None))}
    result = train(make, str(out), ("training",), settings, {"data": "points"}, show_progress=False, num_workers=0,
                   **kwargs)
    return result, tasks[-1] if tasks else None


def test_a_resumed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path):
    whole, _ = _train(tmp_path / "whole", {"accumulate": 2, "batch_size": 2})
    assert _train(tmp_path / "cut", {"accumulate": 2, "batch_size": 2}, stop_after=5)[0] == "stopped"
    state = torch.load(tmp_path / "cut" / "training" / "checkpoint.pt", weights_only=False)
    assert state["step"] == 5 and state["format"] == CHECKPOINT_FORMAT  # the last step before stopping is saved
    resumed, _ = _train(tmp_path / "cut", {"accumulate": 2, "batch_size": 2}, resume=True)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    for name in ("loss_log.csv", "log.csv"):
        def rows(run):
            return [line.split(",")[:-1] for line in (tmp_path / run / "training" / name).read_text().splitlines()]

        assert rows("whole") == rows("cut"), name  # every column but the wall time
    steps = (tmp_path / "whole" / "training" / "loss_log.csv").read_text().splitlines()
    assert steps[0] == "step,loss,norm,lr,seconds" and len(steps) == 13
    epochs = (tmp_path / "whole" / "training" / "log.csv").read_text().splitlines()
    assert epochs[0] == "epoch,train_loss,error,last_lr,seconds" and len(epochs) == 1 + 12 // 6  # 6 steps an epoch


def test_a_run_leaves_the_callers_random_stream_as_it_was(tmp_path):
    """The run seeds its own draws; the caller's next random numbers are those it would have drawn without it."""
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    first, _ = _train(tmp_path / "a")
    assert torch.equal(torch.rand(4), expected)
    second, _ = _train(tmp_path / "b")  # and the run's own result does not depend on the caller's stream
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_accumulated_batches_equal_one_large_batch(tmp_path):
    large, _ = _train(tmp_path / "large", {"batch_size": 8})
    accumulated, _ = _train(tmp_path / "acc", {"batch_size": 4, "accumulate": 2})
    for k in large:
        torch.testing.assert_close(accumulated[k], large[k], rtol=1e-5, atol=1e-6)
    moments = [torch.load(tmp_path / run / "training" / "checkpoint.pt", weights_only=False)["optimizer"]["state"]
               for run in ("large", "acc")]  # Adam's first moment follows the gradients' scale, not only direction
    for i in moments[0]:
        torch.testing.assert_close(moments[1][i]["exp_avg"], moments[0][i]["exp_avg"], rtol=1e-5, atol=1e-7)


def test_amp_runs_the_forward_in_bf16_on_the_cpu_and_keeps_fp32_parameters(tmp_path):
    plain, plain_task = _train(tmp_path / "fp32", {"amp": False})
    amp, amp_task = _train(tmp_path / "bf16", {"amp": True})
    assert plain_task.dtypes == {torch.float32} and amp_task.dtypes == {torch.bfloat16}
    assert all(v.dtype == torch.float32 for v in amp.values())
    assert not all(torch.equal(plain[k], amp[k]) for k in plain)
    for k in plain:
        torch.testing.assert_close(amp[k], plain[k], rtol=0.05, atol=0.02)
    with pytest.raises(ValueError, match="--amp-dtype float16 needs a CUDA --device"):
        _train(tmp_path / "fp16", {"amp": True, "amp_dtype": "float16"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 autocast with a GradScaler needs CUDA; none here")
def test_fp16_amp_scales_the_loss_on_cuda(tmp_path):
    result, task = _train(tmp_path / "fp16", {"amp": True, "amp_dtype": "float16"}, device="cuda")
    assert task.dtypes == {torch.float16} and all(torch.isfinite(v).all() for v in result.values())
    state = torch.load(tmp_path / "fp16" / "training" / "checkpoint.pt", weights_only=False)
    assert state["scaler"]["scale"] > 0


def test_divergence_raises_and_saves_nothing_non_finite(tmp_path):
    with pytest.raises(TrainingDiverged, match="training diverged"):
        _train(tmp_path / "run", {"lr": 1e30, "steps": 30})
    path = tmp_path / "run" / "training" / "checkpoint.pt"
    if path.exists():
        state = torch.load(path, weights_only=True)  # what the engine writes loads so
        assert all(torch.isfinite(t).all() for t in state["trainable"].values())


def test_resume_refuses_a_changed_recipe_another_run_and_an_old_checkpoint(tmp_path, monkeypatch):
    _train(tmp_path / "run", stop_after=2)
    with pytest.raises(ValueError, match=r"other settings \(lr=0.05\)"):
        _train(tmp_path / "run", {"lr": 0.1}, resume=True)
    path = tmp_path / "run" / "training" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)  # what the engine writes loads so
    torch.save({**state, "run": {"data": "elsewhere"}}, path)
    with pytest.raises(ValueError, match="another data"):
        _train(tmp_path / "run", resume=True)
    old = {k: v for k, v in state.items() if k not in ("format", "version")}
    torch.save(old, path)
    with pytest.raises(ValueError, match=r"timm_tokcomp 0.1.0's trainer \(checkpoint format 1"):
        _train(tmp_path / "run", resume=True)
    torch.save({**state, "format": CHECKPOINT_FORMAT + 1, "version": "0.9.0"}, path)
    with pytest.raises(ValueError, match=rf"timm_tokcomp 0.9.0 \(checkpoint format {CHECKPOINT_FORMAT + 1}; this is .*, "
                                         rf"format {CHECKPOINT_FORMAT}"):
        _train(tmp_path / "run", resume=True)


def test_a_resume_on_other_inputs_is_refused_before_the_task_is_built(tmp_path):
    _train(tmp_path / "run", stop_after=2)

    def make(device, world):
        raise AssertionError("the task was built (its data read) before the checkpoint was checked")

    with pytest.raises(ValueError, match=r"another data \(data='points'; now data='other points'\)"):
        train(make, str(tmp_path / "run"), ("training",), {"lr": 0.05, "batch_size": 4, "accumulate": 1, "amp": None},
              {"data": "other points"}, resume=True, show_progress=False)


def test_rank_share_deals_every_batch_to_one_rank():
    shares = [rank_share(10, 4, rank, 2) for rank in (0, 1)]
    assert shares == [[0, 1, 2, 3, 8, 9], [4, 5, 6, 7]]
    assert rank_share(10, 4, 0, 1) == list(range(10))
