"""Lightning: a GAN ``LightningModule`` with manual optimization, the router in ``training_step``.

Lightning's own GAN recipe (manual optimization) runs the discriminator on the fakes twice, detaches the
fakes for D's loss, calls ``manual_backward`` twice and brackets each step with ``toggle_optimizer`` /
``untoggle_optimizer`` so that one loss does not write gradients into the other network. With the router,
``training_step`` is one generator forward, one discriminator forward, one ``router.backward(D=loss_D,
G=loss_G)`` and one ``router.step()``: no ``toggle_optimizer``, no ``detach``, no ``manual_backward``. The
models, losses and data are those of ``gan.py`` (the simultaneous update, see there).

How it fits Lightning:

* The router's groups get the ``LightningOptimizer`` wrappers from ``self.optimizers()``, so every step goes
  through Lightning's strategy and is counted: ``trainer.global_step`` counts optimizer steps, i.e. two per
  iteration here (``max_steps=6`` runs three iterations), as with any two-optimizer manual loop.
* ``precision="16-mixed"``: Lightning's precision plugin would call ``scaler.update()`` after each optimizer's
  step (twice per iteration). ``on_train_start`` takes the plugin's ``GradScaler`` away from it and gives it to
  the router, which updates it once per iteration; the plugin keeps doing the fp16 autocast. (On CPU Lightning
  turns ``"16-mixed"`` into bf16; pass ``--precision 16-mixed`` here and the example installs a CPU fp16
  plugin with a ``GradScaler("cpu")`` itself, so the path runs on CPU as well.) ``bf16-mixed`` and
  ``32-true`` need no scaler.
* DDP (``strategy="ddp"``): Lightning calls ``training_step`` inside DDP's forward, and under manual
  optimization arms DDP's gradient sync in ``manual_backward`` (``strategy.pre_backward``); ``training_step``
  calls ``pre_backward``/``post_backward`` around ``router.backward`` for the same reason (no-ops on one
  device). Tested on 2 processes (``tests/integration/test_lightning_ddp.py``).
* ``Router(accumulate=N)`` accumulates: the optimizers step (and ``global_step`` advances) every N batches.
  The router's ``state_dict()`` is saved with Lightning's checkpoints (``on_save_checkpoint``).

Run::

    python examples/lightning_train.py --max-steps 400
    python examples/lightning_train.py --precision 16-mixed --accumulate 2
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from gan import gan_losses, make_models, sample_real

import gradroute


class RoutedGAN(L.LightningModule):
    def __init__(self, z_dim: int = 8, lr_g: float = 2e-4, lr_d: float = 2e-4, accumulate: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator, self.discriminator = make_models(z_dim)
        self.router: gradroute.Router | None = None
        self._router_state: dict[str, Any] | None = None
        self.iterations = 0

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        hp = self.hparams
        return [
            torch.optim.Adam(self.generator.parameters(), lr=hp.lr_g, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=hp.lr_d, betas=(0.5, 0.999)),
        ]

    def on_train_start(self) -> None:
        opt_g, opt_d = self.optimizers()
        plugin = self.trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None:
            plugin.scaler = None  # the router updates it once per iteration; the plugin only autocasts now
        self.router = gradroute.Router(
            G=gradroute.Group(self.generator, optimizer=opt_g),
            D=gradroute.Group(self.discriminator, optimizer=opt_d),
            scaler=scaler,
            accumulate=self.hparams.accumulate,
        )
        if self._router_state is not None:
            self.router.load_state_dict(self._router_state)

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        assert self.router is not None
        real, z = batch
        loss_d, loss_g = gan_losses(self.discriminator, real, self.generator(z))
        # Under DDP, Lightning runs training_step inside DDP's forward, so DDP has not armed its gradient sync
        # yet: manual_backward would do it first (strategy.pre_backward); the routed backward does the same.
        self.trainer.strategy.pre_backward(loss_d)
        self.router.backward(D=loss_d, G=loss_g)
        self.trainer.strategy.post_backward(loss_d)
        stats = self.router.step()
        self.iterations += 1
        if not stats.accumulating:
            self.log_dict({"loss_D": stats["D"].loss, "loss_G": stats["G"].loss}, prog_bar=True)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.router is not None:
            checkpoint["gradroute"] = self.router.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._router_state = checkpoint.get("gradroute")  # applied when the router is built


def make_loader(n: int, batch_size: int, z_dim: int, seed: int) -> torch.utils.data.DataLoader:
    """Real points and noise, drawn up front (a fixed order, no shuffling: reproducible)."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(sample_real(n, gen), torch.randn(n, z_dim, generator=gen))
    return torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False)


def make_trainer(precision: str, max_steps: int, **kwargs: Any) -> L.Trainer:
    """A CPU-friendly Trainer; ``16-mixed`` on CPU gets an fp16 plugin with a ``GradScaler("cpu")``."""
    accelerator = kwargs.pop("accelerator", "auto")
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if precision == "16-mixed" and on_cpu:
        from lightning.pytorch.plugins.precision import MixedPrecision

        kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    else:
        kwargs["precision"] = precision
    return L.Trainer(accelerator=accelerator, max_steps=max_steps, **kwargs)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=400, help="optimizer steps (two per iteration)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--precision", choices=("32-true", "bf16-mixed", "16-mixed"), default="32-true")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for flag in ("max_steps", "batch_size", "accumulate"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    model = RoutedGAN(accumulate=args.accumulate)
    loader = make_loader(64 * args.batch_size, args.batch_size, model.hparams.z_dim, args.seed)
    trainer = make_trainer(
        args.precision,
        args.max_steps,
        accelerator=args.accelerator,
        logger=False,
        enable_checkpointing=False,
        max_epochs=-1,
    )
    trainer.fit(model, loader)
    metrics = "  ".join(f"{k} {float(v):.4f}" for k, v in trainer.logged_metrics.items())
    print(f"{model.iterations} iterations, global_step {trainer.global_step}: {metrics}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
