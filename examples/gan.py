"""A GAN with one discriminator forward on the fakes: ``loss_D`` trains D, ``loss_G`` trains G, routed.

The generator maps noise to 2-D points; the discriminator scores real points (a ring of eight Gaussians) and
fakes in ONE forward of ``torch.cat([real, fake])``. Both losses come from that forward:

* ``loss_D = bce(D(real), 1) + bce(D(fake), 0)`` is routed to D only (no ``fake.detach()`` needed: the router
  does not even traverse G for it),
* ``loss_G = bce(D(fake), 1)`` (non-saturating) is routed to G only (no gradient is written into D).

**Which update is this?** ``--mode simultaneous`` (the default) is the *simultaneous* update: both gradients
are taken at the current parameters of both networks, then both optimizers step. It saves the second
discriminator forward on the fakes that the textbook loop needs, but it is not the same algorithm as the
textbook *alternating* loop, where G's loss is evaluated with the discriminator already updated.

``--mode alternating`` is the exact equivalent of the textbook loop::

    fake = G(z)
    loss_D = bce(D(real), 1) + bce(D(fake.detach()), 0); loss_D.backward(); opt_D.step()
    loss_G = bce(D(fake), 1); opt_G.zero_grad(); loss_G.backward(); opt_G.step()   # writes D's .grad too

It needs the second discriminator forward (at D's new parameters) like the textbook loop; the router still
saves the ``detach`` and the wasted discriminator gradients of ``loss_G``. One G forward serves both steps:
routing ``loss_D`` to D leaves G's part of the graph untouched, and ``router.step()`` steps only the groups
that received gradients.

The discriminator has no batch-coupled layers (no BatchNorm), so scoring ``cat([real, fake])`` in one
forward equals scoring them separately.

Run::

    python examples/gan.py --steps 2000            # prints losses; a few seconds on CPU
    python examples/gan.py --mode alternating
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

import gradroute


def make_models(z_dim: int = 8, hidden: int = 64) -> tuple[nn.Module, nn.Module]:
    """``(G, D)``: noise ``z_dim`` -> 2-D point, and 2-D point -> logit."""
    generator = nn.Sequential(
        nn.Linear(z_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 2)
    )
    discriminator = nn.Sequential(
        nn.Linear(2, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1)
    )
    return generator, discriminator


def sample_real(n: int, gen: torch.Generator | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``n`` points from eight Gaussians (std 0.05) on the unit circle."""
    k = torch.randint(0, 8, (n,), generator=gen)
    angle = k.to(torch.float64) * (2 * math.pi / 8)
    centers = torch.stack([angle.cos(), angle.sin()], dim=1)
    return (centers + 0.05 * torch.randn(n, 2, generator=gen, dtype=torch.float64)).to(dtype)


def gan_losses(discriminator: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_D, loss_G)`` from ONE discriminator forward of ``cat([real, fake])``."""
    logits = discriminator(torch.cat([real, fake]))
    real_logits, fake_logits = logits[: len(real)], logits[len(real) :]
    loss_d = F.binary_cross_entropy_with_logits(
        real_logits, torch.ones_like(real_logits)
    ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))
    loss_g = F.binary_cross_entropy_with_logits(fake_logits, torch.ones_like(fake_logits))
    return loss_d, loss_g


def make_router(
    generator: nn.Module, discriminator: nn.Module, *, lr_g: float = 2e-4, lr_d: float = 2e-4
) -> gradroute.Router:
    """Groups ``G`` and ``D``, each with its own Adam (betas (0.5, 0.999), the usual GAN setting)."""
    return gradroute.Router(
        G=gradroute.Group(generator, optimizer=torch.optim.Adam(generator.parameters(), lr=lr_g, betas=(0.5, 0.999))),
        D=gradroute.Group(
            discriminator, optimizer=torch.optim.Adam(discriminator.parameters(), lr=lr_d, betas=(0.5, 0.999))
        ),
    )


def simultaneous_step(
    router: gradroute.Router, generator: nn.Module, discriminator: nn.Module, real: torch.Tensor, z: torch.Tensor
) -> tuple[float, float]:
    """One G forward, one D forward, both losses routed, both optimizers stepped. Returns the two losses."""
    loss_d, loss_g = gan_losses(discriminator, real, generator(z))
    router.backward(D=loss_d, G=loss_g)
    stats = router.step()
    return stats["D"].loss, stats["G"].loss


def alternating_step(
    router: gradroute.Router, generator: nn.Module, discriminator: nn.Module, real: torch.Tensor, z: torch.Tensor
) -> tuple[float, float]:
    """The textbook loop, exactly: D steps on ``loss_D``, then ``loss_G`` is taken through the updated D."""
    fake = generator(z)
    loss_d, _ = gan_losses(discriminator, real, fake)
    router.backward(D=loss_d)
    stats_d = router.step()  # steps D only: G received no gradient
    _, loss_g = gan_losses(discriminator, real, fake)  # the second D forward, at D's new parameters
    router.backward(G=loss_g)
    stats_g = router.step()
    return stats_d["D"].loss, stats_g["G"].loss


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("simultaneous", "alternating"), default="simultaneous")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--z-dim", type=int, default=8)
    p.add_argument("--lr-g", type=float, default=2e-4)
    p.add_argument("--lr-d", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--log-every", type=int, default=100)
    args = p.parse_args(argv)
    for flag in ("steps", "batch_size", "z_dim", "log_every"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    generator, discriminator = (m.to(device) for m in make_models(args.z_dim))
    router = make_router(generator, discriminator, lr_g=args.lr_g, lr_d=args.lr_d)
    step_fn = simultaneous_step if args.mode == "simultaneous" else alternating_step
    data_gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        real = sample_real(args.batch_size, data_gen).to(device)
        z = torch.randn(args.batch_size, args.z_dim, generator=data_gen).to(device)
        loss_d, loss_g = step_fn(router, generator, discriminator, real, z)
        if step % args.log_every == 0 or step == args.steps:
            print(f"step {step:5d}  loss_D {loss_d:.4f}  loss_G {loss_g:.4f}", flush=True)
    with torch.no_grad():
        fake = generator(torch.randn(1024, args.z_dim, generator=data_gen).to(device))
        radius = fake.norm(dim=1)
    print(
        f"{args.mode}: {args.steps} steps in {time.perf_counter() - start:.1f} s; fake points at radius "
        f"{radius.mean():.2f} +- {radius.std():.2f} (real: 1.00 +- 0.05)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
