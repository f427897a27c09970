"""examples/lightning_train.py on 2 processes (Lightning's ``ddp_spawn``, gloo on the CPU).

Lightning runs ``training_step`` inside DDP's forward, so under manual optimization DDP's gradient sync is armed
by ``manual_backward`` (``strategy.pre_backward``), not by the forward; the routed backward must do the same or
every process keeps its own gradients. Each process records the batches it saw and the gradients its optimizers
were about to apply; the reference is a fresh forward per loss on those batches, averaged over the processes and
the micro-batches.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

lt = pytest.importorskip("lightning_train")


class RecordingGAN(lt.RoutedGAN):  # type: ignore[name-defined, misc]
    """The example's module with SGD (a gradient scale shows), writing what each process saw and applied."""

    def __init__(self, out: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.out = out
        self.seen: list[Any] = []
        self.applied: list[Any] = []

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(m.parameters(), lr=0.05) for m in (self.generator, self.discriminator)]

    def on_train_start(self) -> None:
        super().on_train_start()

        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.applied.append([p.grad.clone() for g in opt.param_groups for p in g["params"]])
            torch.save({"seen": self.seen, "applied": self.applied}, f"{self.out}/rank{self.global_rank}.pt")

        self._hook = register_optimizer_step_pre_hook(hook)

    def on_train_end(self) -> None:
        self._hook.remove()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.seen.append([t.clone() for t in batch])
        super().training_step(batch, batch_idx)


@pytest.mark.distributed
def test_lightning_example_two_processes_match_the_reference(tmp_path: Path) -> None:
    import gan
    import lightning as L

    torch.manual_seed(0)
    accumulate = 2
    model = RecordingGAN(str(tmp_path), z_dim=8, accumulate=accumulate)
    ref_g, ref_d = copy.deepcopy(model.generator), copy.deepcopy(model.discriminator)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=2,  # one real step: each of the two optimizers steps once
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, lt.make_loader(128, 16, 8, seed=1))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for a, b in zip(ranks[0]["applied"], ranks[1]["applied"], strict=True):  # DDP: the same averaged gradients
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert len(ranks[0]["applied"]) == 2 and len(ranks[0]["seen"]) == accumulate
    for k, net in enumerate((ref_g, ref_d)):  # G's optimizer steps first, then D's
        expected = [torch.zeros_like(p) for p in net.parameters()]
        for rank in ranks:
            for real, z in rank["seen"]:
                loss = gan.gan_losses(ref_d, real, ref_g(z))[1 - k]  # a fresh forward per loss
                for e, g in zip(expected, torch.autograd.grad(loss, list(net.parameters())), strict=True):
                    e += g / (2 * accumulate)
        for got, want in zip(ranks[0]["applied"][k], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
