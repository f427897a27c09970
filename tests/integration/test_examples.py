"""The examples on their real stacks (diffusers, transformers, peft, accelerate, lightning, torch.compile), on CPU.

Every exactness check compares against an independent reference: a fresh forward per loss and
``torch.autograd.grad`` (``tests/_reference.py``), or a textbook training loop written here with plain
``backward``/``zero_grad``/``step``.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import gradroute
from gradroute import _compat
from tests._reference import assert_grads_match, reference_grads

CPU = torch.device("cpu")


def no_autocast() -> Any:
    return contextlib.nullcontext()


def max_rel_error(text: str) -> float:
    m = re.search(r"max relative error (\S+)", text)
    assert m is not None, text
    return float(m.group(1))


def params_of(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


def assert_same_params(got: torch.nn.Module, want: torch.nn.Module, *, rtol: float, atol: float) -> None:
    for (name, p), q in zip(got.named_parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def counting(fn: Callable[..., Any], calls: list[Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapper


# ================================================================================== Stable Diffusion (diffusers)


def sd_inputs(models: Any, data_dir: Path, batch_size: int = 2) -> Any:
    import sd_masked_finetune as sd

    ds = sd.MaskedCaptions(sd.read_dataset(data_dir), models.tokenizer, 16)
    batch = next(sd.batches(ds, batch_size, seed=0))
    return sd.draw_inputs(models, batch, torch.Generator().manual_seed(0), CPU, no_autocast)


@pytest.mark.parametrize("lora_rank", [0, 2])
@pytest.mark.parametrize("checkpointing", [None, "blocks", "gradroute", "torch"])
def test_sd_routed_grads_match_fresh_forwards(tiny_sd: Path, checkpointing: str | None, lora_rank: int) -> None:
    import sd_masked_finetune as sd

    models = sd.load_models(tiny_sd / "model", CPU, lora_rank=lora_rank, gradient_checkpointing=checkpointing)
    x = sd_inputs(models, tiny_sd / "data")
    groups = {"tenc": params_of(models.tenc), "unet": params_of(models.unet)}

    def forward() -> dict[str, torch.Tensor]:
        loss_tenc, loss_unet = sd.losses(models, x, no_autocast)
        return {"tenc": loss_tenc, "unet": loss_unet}

    expected = reference_grads(forward, groups)
    router = gradroute.Router(groups)
    losses = forward()
    notes = " ".join(router.plan(**losses).notes)
    # the default mode's cut points let the passes share every recomputation (none recomputed per call)
    assert "recomputed once per call" not in notes, notes
    router.backward(**losses)
    del losses
    for name, params in groups.items():
        assert_grads_match(params, expected, rtol=1e-5, atol=1e-8)
        assert any(float(p.grad.abs().sum()) > 0 for p in params), name
    # the losses really differ: a plain backward of the sum would have given other gradients
    summed = torch.autograd.grad(sum(forward().values()), groups["tenc"], materialize_grads=True)
    assert any(not torch.allclose(s, expected[id(p)]) for s, p in zip(summed, groups["tenc"], strict=True))


def run_sd(root: Path, out: Path, *extra: str, model_dir: Path | None = None) -> int:
    import sd_masked_finetune as sd

    return sd.main(
        [
            "--model-dir",
            str(model_dir or root / "model"),
            "--data-dir",
            str(root / "data"),
            "--output-dir",
            str(out),
            "--max-steps",
            "3",
            "--warmup-steps",
            "1",
            "--tenc-lr",
            "1e-3",
            "--unet-lr",
            "1e-3",
            "--device",
            "cpu",
            *extra,
        ]
    )


def test_sd_main_trains_checks_grads_and_saves(
    tiny_sd: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    out = tmp_path / "out"
    rc = run_sd(tiny_sd, out, "--check-grads", "--accumulate", "2", "--max-grad-norm", "1.0")
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "step 3/3" in text
    assert max_rel_error(text) <= 1e-5
    src = tiny_sd / "model"
    for cls, sub in ((UNet2DConditionModel, "unet"), (CLIPTextModel, "text_encoder")):
        trained, base = cls.from_pretrained(out / sub), cls.from_pretrained(src / sub)
        changed = [not torch.equal(p, q) for p, q in zip(trained.parameters(), base.parameters(), strict=True)]
        assert all(torch.isfinite(p).all() for p in trained.parameters())
        assert sum(changed) > len(changed) // 2, f"{sub}: {sum(changed)} of {len(changed)} parameters changed"
    vae, vae_base = AutoencoderKL.from_pretrained(out / "vae"), AutoencoderKL.from_pretrained(src / "vae")
    assert all(torch.equal(p, q) for p, q in zip(vae.parameters(), vae_base.parameters(), strict=True))
    caption = "a cat on the mat"
    assert (
        CLIPTokenizer.from_pretrained(out / "tokenizer")(caption).input_ids
        == CLIPTokenizer.from_pretrained(src / "tokenizer")(caption).input_ids
    )
    assert DDPMScheduler.from_pretrained(out / "scheduler").config.num_train_timesteps == 1000


@pytest.mark.parametrize(
    ("extra", "pixel_space"),
    [
        (["--gradient-checkpointing"], False),  # gradroute
        (["--gradient-checkpointing", "torch"], False),
        (["--mixed-precision", "fp16"], False),  # CPU fp16 autocast + GradScaler("cpu"), driven by the router
        (["--mixed-precision", "bf16", "--gradient-checkpointing", "blocks"], False),
        ([], True),  # no vae/: the UNet trains on RGB pixels
    ],
    ids=["checkpointing-gradroute", "checkpointing-torch", "fp16-scaler", "bf16-checkpointing-blocks", "pixel-space"],
)
def test_sd_main_check_grads_variants(
    tiny_sd: Path,
    tiny_sd_pixel: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    pixel_space: bool,
) -> None:
    model_dir = tiny_sd_pixel if pixel_space else None
    rc = run_sd(tiny_sd, tmp_path / "out", "--check-grads", "--max-steps", "1", *extra, model_dir=model_dir)
    text = capsys.readouterr().out
    assert rc == 0, text
    # the reference runs in the same precision (and, for fp16, with the same loss scale)
    assert max_rel_error(text) <= 1e-5


def test_sd_main_lora_saves_adapters_and_merged_models(
    tiny_sd: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from diffusers import UNet2DConditionModel
    from peft import PeftModel
    from transformers import CLIPTextModel

    out = tmp_path / "out"
    rc = run_sd(tiny_sd, out, "--lora-rank", "2", "--check-grads", "--max-steps", "2")
    text = capsys.readouterr().out
    assert rc == 0, text
    assert max_rel_error(text) <= 1e-5
    for cls, sub, targets in (
        (UNet2DConditionModel, "unet", ("to_q", "to_k", "to_v", "to_out.0")),
        (CLIPTextModel, "text_encoder", ("q_proj", "k_proj", "v_proj", "out_proj")),
    ):
        merged = dict(cls.from_pretrained(out / sub).named_parameters())
        base = dict(cls.from_pretrained(tiny_sd / "model" / sub).named_parameters())
        adapter = PeftModel.from_pretrained(cls.from_pretrained(tiny_sd / "model" / sub), out / "lora" / sub)
        remerged = dict(adapter.merge_and_unload().named_parameters())
        assert merged.keys() == base.keys() == remerged.keys()
        for name, p in merged.items():
            torch.testing.assert_close(p, remerged[name], rtol=1e-6, atol=1e-7)
            lora_target = name.endswith(".weight") and any(f".{t}.weight" in f".{name}" for t in targets)
            # only LoRA-adapted weights changed; everything else was frozen
            assert torch.equal(p, base[name]) != lora_target, name


def test_sd_naive_sum_fails_the_grad_check(tiny_sd: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = run_sd(tiny_sd, tmp_path / "out", "--naive-sum", "--check-grads", "--max-steps", "1")
    text = capsys.readouterr().out
    assert rc == 1
    assert "FAILED" in text
    assert max_rel_error(text) > 1e-2


def _usage_error(rc: int, capsys: pytest.CaptureFixture[str], *words: str) -> None:
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("error: ") and "\n" not in err, err
    for w in words:
        assert w in err, err


def test_sd_missing_model_dir_fails(tiny_sd: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = run_sd(tiny_sd, tmp_path / "out", model_dir=tmp_path / "nope")
    _usage_error(rc, capsys, "`--model-dir`", "nope", "does not exist")


def test_sd_model_dir_without_unet_fails(tiny_sd: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_sd / "model", model, ignore=shutil.ignore_patterns("unet"))
    rc = run_sd(tiny_sd, tmp_path / "out", model_dir=model)
    _usage_error(rc, capsys, "`--model-dir`", "unet/")


def test_sd_unknown_checkpointing_mode_fails(tiny_sd: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import sd_masked_finetune as sd

    with pytest.raises(sd.UsageError, match=r"`--gradient-checkpointing` must be one of gradroute, blocks, torch"):
        sd.load_models(tiny_sd / "model", CPU, gradient_checkpointing="layers")
    with pytest.raises(SystemExit):  # argparse: a choice it does not know
        run_sd(tiny_sd, tmp_path / "out", "--gradient-checkpointing", "layers")
    assert "invalid choice: 'layers'" in capsys.readouterr().err


def test_sd_missing_data_dir_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_sd: Path) -> None:
    import sd_masked_finetune as sd

    rc = sd.main(
        ["--model-dir", str(tiny_sd / "model"), "--data-dir", str(tmp_path / "nope"), "--output-dir", str(tmp_path)]
    )
    _usage_error(rc, capsys, "`--data-dir`", "does not exist")


def test_sd_mask_size_mismatch_fails(
    tiny_sd: Path, data_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import numpy as np
    import sd_masked_finetune as sd
    from PIL import Image

    Image.fromarray(np.zeros((8, 12), dtype=np.uint8)).save(data_copy / "masks" / "2.png")
    rc = sd.main(
        ["--model-dir", str(tiny_sd / "model"), "--data-dir", str(data_copy), "--output-dir", str(tmp_path / "o")]
    )
    _usage_error(rc, capsys, "2.png", "12x8", "16x16")


def test_sd_empty_dataset_fails(
    tiny_sd: Path, data_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import sd_masked_finetune as sd

    (data_copy / "captions.txt").write_text("# no examples yet\n\n")
    rc = sd.main(
        ["--model-dir", str(tiny_sd / "model"), "--data-dir", str(data_copy), "--output-dir", str(tmp_path / "o")]
    )
    _usage_error(rc, capsys, "empty")


# =========================================================================================================== GAN


def gan_models(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    import gan

    torch.manual_seed(seed)
    generator, discriminator = gan.make_models(z_dim=4, hidden=16)
    return generator.double(), discriminator.double()


def gan_batches(n: int, batch: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    import gan

    gen = torch.Generator().manual_seed(1)
    return [
        (gan.sample_real(batch, gen, torch.float64), torch.randn(batch, 4, generator=gen, dtype=torch.float64))
        for _ in range(n)
    ]


def test_gan_routed_grads_match_fresh_forwards() -> None:
    import gan

    generator, discriminator = gan_models()
    real, z = gan_batches(1)[0]
    groups = {"G": params_of(generator), "D": params_of(discriminator)}

    def forward() -> dict[str, torch.Tensor]:
        loss_d, loss_g = gan.gan_losses(discriminator, real, generator(z))
        return {"D": loss_d, "G": loss_g}

    expected = reference_grads(forward, groups)
    router = gradroute.Router(groups)
    router.backward(**forward())
    for params in groups.values():
        assert_grads_match(params, expected, rtol=1e-12, atol=1e-14)


def adam_pair(generator: torch.nn.Module, discriminator: torch.nn.Module) -> tuple[Any, Any]:
    return (
        torch.optim.Adam(generator.parameters(), lr=1e-2, betas=(0.5, 0.999)),
        torch.optim.Adam(discriminator.parameters(), lr=1e-2, betas=(0.5, 0.999)),
    )


def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


@pytest.mark.parametrize("mode", ["simultaneous", "alternating"])
def test_gan_training_matches_textbook_loop(mode: str) -> None:
    import gan

    generator, discriminator = gan_models()
    ref_g, ref_d = copy.deepcopy(generator), copy.deepcopy(discriminator)
    router = gan.make_router(generator, discriminator, lr_g=1e-2, lr_d=1e-2)
    opt_g, opt_d = adam_pair(ref_g, ref_d)
    step = gan.simultaneous_step if mode == "simultaneous" else gan.alternating_step
    for real, z in gan_batches(4):
        step(router, generator, discriminator, real, z)
        # the textbook loop: separate forwards (D on real and on detached fakes), zero_grad, backward, step
        fake = ref_g(z)
        loss_d = bce(ref_d(real), 1.0) + bce(ref_d(fake.detach()), 0.0)
        if mode == "simultaneous":  # G's gradient at D's current parameters, then both step
            loss_g = bce(ref_d(fake), 1.0)
            grads_g = torch.autograd.grad(loss_g, list(ref_g.parameters()))
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            for p, g in zip(ref_g.parameters(), grads_g, strict=True):
                p.grad = g
            opt_g.step()
        else:  # D steps first; G's loss through the updated D
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(ref_d(fake), 1.0).backward()
            opt_g.step()
    assert_same_params(generator, ref_g, rtol=1e-10, atol=1e-12)
    assert_same_params(discriminator, ref_d, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["simultaneous", "alternating"])
def test_gan_main_runs(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    import gan

    argv = ["--mode", mode, "--steps", "20", "--batch-size", "16", "--log-every", "10", "--device", "cpu"]
    assert gan.main(argv) == 0
    text = capsys.readouterr().out
    assert f"{mode}: 20 steps" in text
    assert "step    20" in text


# ================================================================================================== actor-critic


def td3_setup(seed: int = 0) -> tuple[Any, Any]:
    import actor_critic as ac

    torch.manual_seed(seed)
    return ac.Actor(4, 2, hidden=16).double(), ac.Critic(4, 2, hidden=16).double()


def td3_batch(gen: torch.Generator, n: int = 32) -> Any:
    import actor_critic as ac

    return ac.synthetic_batch(n, 4, 2, gen, torch.float64)


def linear_weight_grad_flops(module: torch.nn.Module, batch: int) -> int:
    """Flops of the weight-gradient matrix products of every Linear layer (``2 * batch * in * out`` each)."""
    return sum(2 * batch * m.in_features * m.out_features for m in module.modules() if isinstance(m, torch.nn.Linear))


def test_td3_actor_loss_computes_no_critic_gradients() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    actor, critic = td3_setup()
    b = td3_batch(torch.Generator().manual_seed(1))
    router = gradroute.Router(actor=actor, critic=critic)
    hooked: list[Any] = []
    for p in critic.parameters():
        p.register_hook(counting(lambda g: None, hooked))

    def actor_loss() -> torch.Tensor:
        return -critic(b.s, actor(b.s))[0].mean()

    expected = reference_grads(lambda: {"actor": actor_loss()}, {"actor": params_of(actor)})
    plan = router.plan(actor=actor_loss())
    assert sum(c.params for c in plan.calls) == len(params_of(actor))  # only the actor's parameters are inputs
    loss = actor_loss()
    with FlopCounterMode(display=False) as routed:
        router.backward(actor=loss)
    assert_grads_match(params_of(actor), expected, rtol=1e-12, atol=1e-14)
    assert all(p.grad is None for p in critic.parameters())  # none written
    assert hooked == []  # no critic parameter's gradient reached the engine's accumulation

    loss = actor_loss()
    with FlopCounterMode(display=False) as plain:
        loss.backward()
    assert len(hooked) == len(list(critic.q1.parameters()))  # the hooks do fire on a plain backward (Q1's)
    # none wasted: exactly the critic's weight-gradient products (Q1; Q2 is not on the actor loss) are skipped
    saved = plain.get_total_flops() - routed.get_total_flops()
    assert saved == linear_weight_grad_flops(critic.q1, batch=len(b.s))


@pytest.mark.parametrize("mode", ["td3", "simultaneous"])
def test_td3_training_matches_textbook_loop(mode: str) -> None:
    import actor_critic as ac

    actor, critic = td3_setup()
    agent = ac.TD3.create(actor, critic, lr_actor=1e-2, lr_critic=1e-2)
    ref_a, ref_c = copy.deepcopy(actor), copy.deepcopy(critic)
    ref_at, ref_ct = copy.deepcopy(actor), copy.deepcopy(critic)
    opt_a, opt_c = torch.optim.Adam(ref_a.parameters(), lr=1e-2), torch.optim.Adam(ref_c.parameters(), lr=1e-2)
    data_gen = torch.Generator().manual_seed(1)
    noise_gen, ref_noise_gen = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    for it in range(1, 5):
        b = td3_batch(data_gen)
        agent.update(b, simultaneous=mode == "simultaneous", gen=noise_gen)
        # textbook TD3 (Fujimoto et al.), written out
        with torch.no_grad():
            noise = (torch.randn(b.a.shape, generator=ref_noise_gen, dtype=b.a.dtype) * 0.2).clamp(-0.5, 0.5)
            a2 = (ref_at(b.s2) + noise).clamp(-1, 1)
            y = b.r + b.not_done * 0.99 * torch.min(*ref_ct(b.s2, a2))
        q1, q2 = ref_c(b.s, b.a)
        critic_loss = F.mse_loss(q1, y) + F.mse_loss(q2, y)
        if it % 2:  # critic only
            opt_c.zero_grad()
            critic_loss.backward()
            opt_c.step()
            continue
        if mode == "td3":  # critic steps, then the actor loss through the updated critic
            opt_c.zero_grad()
            critic_loss.backward()
            opt_c.step()
            opt_a.zero_grad()
            (-ref_c(b.s, ref_a(b.s))[0].mean()).backward()
            opt_a.step()
        else:  # both gradients at the current parameters, each from its own forward
            grads_a = torch.autograd.grad(-ref_c(b.s, ref_a(b.s))[0].mean(), list(ref_a.parameters()))
            opt_c.zero_grad()
            critic_loss.backward()
            opt_c.step()
            for p, g in zip(ref_a.parameters(), grads_a, strict=True):
                p.grad = g
            opt_a.step()
        with torch.no_grad():
            for net, tgt in ((ref_a, ref_at), (ref_c, ref_ct)):
                for p, pt in zip(net.parameters(), tgt.parameters(), strict=True):
                    pt.mul_(0.995).add_(p, alpha=0.005)
    for got, want in ((actor, ref_a), (critic, ref_c), (agent.actor_target, ref_at), (agent.critic_target, ref_ct)):
        assert_same_params(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", ["td3", "simultaneous"])
def test_actor_critic_main_runs(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    import actor_critic as ac

    argv = ["--mode", mode, "--steps", "6", "--batch-size", "16", "--log-every", "2", "--device", "cpu"]
    assert ac.main(argv) == 0
    text = capsys.readouterr().out
    assert "actor loss" in text and "critic loss" in text


# ===================================================================================================== Lightning


def lightning_fit(precision: str, max_steps: int, accumulate: int = 1, spy: list[Any] | None = None) -> tuple[Any, ...]:
    import lightning_train as lt

    torch.manual_seed(0)
    model = lt.RoutedGAN(z_dim=8, lr_g=1e-2, lr_d=1e-2, accumulate=accumulate)
    initial = copy.deepcopy(model.generator), copy.deepcopy(model.discriminator)
    loader = lt.make_loader(64, 16, 8, seed=1)
    trainer = lt.make_trainer(
        precision,
        max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if spy is not None:
        assert scaler is not None
        scaler.update = counting(scaler.update, spy)
    trainer.fit(model, loader)
    return model, trainer, initial, loader


def test_lightning_trainer_matches_reference_loop() -> None:
    import gan

    model, trainer, (ref_g, ref_d), loader = lightning_fit("32-true", max_steps=3)
    # two optimizers step per iteration: max_steps=3 stops after the second iteration (global_step 4)
    assert model.iterations == 2
    assert trainer.global_step == 4
    opt_g, opt_d = (torch.optim.Adam(m.parameters(), lr=1e-2, betas=(0.5, 0.999)) for m in (ref_g, ref_d))
    for (real, z), _ in zip(loader, range(model.iterations), strict=False):
        for net, k in ((ref_d, 0), (ref_g, 1)):
            loss = gan.gan_losses(ref_d, real, ref_g(z))[k]  # a fresh forward per loss
            for p, g in zip(net.parameters(), torch.autograd.grad(loss, list(net.parameters())), strict=True):
                p.grad = g
        opt_d.step()
        opt_g.step()
    assert_same_params(model.generator, ref_g, rtol=1e-5, atol=1e-6)
    assert_same_params(model.discriminator, ref_d, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_fp16_router_owns_the_scaler(accumulate: int) -> None:
    updates: list[Any] = []
    model, trainer, _, _ = lightning_fit("16-mixed", max_steps=6, accumulate=accumulate, spy=updates)
    assert trainer.precision_plugin.scaler is None  # taken from the plugin: it no longer updates per optimizer
    assert model.iterations == 3 * accumulate
    assert trainer.global_step == 6
    assert len(updates) == 3  # one per real step, not one per optimizer
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightning_main_runs(precision: str, capsys: pytest.CaptureFixture[str]) -> None:
    import lightning_train as lt

    assert lt.main(["--max-steps", "4", "--batch-size", "16", "--precision", precision, "--accelerator", "cpu"]) == 0
    assert "2 iterations, global_step 4" in capsys.readouterr().out


# ================================================================================================= torch.compile


def compiled_nodes(loss: torch.Tensor) -> int:
    """How many AOTAutograd ``CompiledFunctionBackward`` nodes the graph below ``loss`` holds."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
    return sum("CompiledFunction" in type(n).__name__ for n in seen)


def test_compile_router_exact_on_compiled_models(tiny_sd: Path) -> None:
    import sd_masked_finetune as sd

    torch._dynamo.reset()
    models = sd.load_models(tiny_sd / "model", CPU)
    x = sd_inputs(models, tiny_sd / "data")
    groups = {"tenc": params_of(models.tenc), "unet": params_of(models.unet)}

    def forward(m: Any) -> Callable[[], dict[str, torch.Tensor]]:
        def losses() -> dict[str, torch.Tensor]:
            loss_tenc, loss_unet = sd.losses(m, x, no_autocast)
            return {"tenc": loss_tenc, "unet": loss_unet}

        return losses

    eager = reference_grads(forward(models), groups)
    # as the example does: no donated buffers, so that a plain backward through the compiled modules may come
    # first (it compiles their backward for single use) and routed passes that retain still work after it
    with _compat.no_donated_buffers():
        compiled = sd.Models(
            models.tokenizer,
            torch.compile(models.tenc, backend="aot_eager"),
            torch.compile(models.unet, backend="aot_eager"),
            models.scheduler,
            models.vae,
        )
        same = reference_grads(forward(compiled), groups)  # plain backward per loss, through the compiled modules
        router = gradroute.Router(groups)
        for _ in range(2):
            losses = forward(compiled)()
            assert compiled_nodes(losses["unet"]) == 2  # the text encoder's and the UNet's compiled backward
            router.backward(**losses)
            for params in groups.values():
                assert_grads_match(params, same, rtol=1e-6, atol=1e-9)
                assert_grads_match(params, eager, rtol=1e-5, atol=1e-8)  # aot_eager runs eager kernels
            router.zero_grad()
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compile_router_main(backend: str, tiny_sd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import compile_router

    torch._dynamo.reset()
    rc = compile_router.main(["--backend", backend, "--model-dir", str(tiny_sd / "model"), "--repeat", "2"])
    text = capsys.readouterr().out
    torch._dynamo.reset()
    assert rc == 0, text
    assert max_rel_error(text) <= 1e-4
