"""The ``gradroute`` command line: ``gradroute demo`` and ``gradroute bench`` (``python -m gradroute ...``).

Never imported by ``import gradroute``: the library needs none of it (nor matplotlib, diffusers, ...). This
``__init__`` imports nothing; each command's modules are imported when that command runs.

Layout (one job per module):

* ``main``: the argument parser and ``main(argv) -> exit code`` (the ``gradroute`` console script).
* ``choices``: the names the command line accepts (workloads, strategies, dtypes), torch-free so that
  ``--help`` stays fast; everything else reads them from here.
* ``common``: helpers both commands use (device and dtype resolution, relative error, matplotlib, the tqdm
  progress bar).
* ``data``, ``noise``, ``models``: the embedded captioned-shapes data, its noise schedule and the tiny text
  encoder and UNet (``gradroute demo`` and the ``sd-tiny`` workload).
* ``demo``: ``command`` (the training run), ``check`` (the step-0 check against independent forwards),
  ``plot`` (demo.png), ``distributed`` (torchrun).
* ``workloads``: ``Workload`` and ``build`` in the package, one module per workload (``sd_tiny``, ``gan``,
  ``actor_critic``, ``sd15``).
* ``bench``: ``command`` (the run and its report), ``runner`` (a workload, its router and precision),
  ``strategies`` (the ways of routing two losses), ``measure`` (errors and interleaved timing), ``memory``
  (peak memory), ``report`` (the ratios, their bounds and the Markdown table), ``plot`` (the bar chart).

Supported import paths (``benchmarks/`` and the tests use these and nothing else from this package):

* ``gradroute.cli.main.main``, ``gradroute.cli.main.build_parser``
* ``gradroute.cli.data.make_batch`` (and ``tokenize``, ``render``, ``VOCAB``, ``COLOURS``, ``SHAPES``,
  ``POSITIONS``, ``IMAGE_SIZE``, ``MAX_TOKENS``)
* ``gradroute.cli.noise.NoiseSchedule``, ``gradroute.cli.noise.SCHEDULE``
* ``gradroute.cli.models.make_models``, ``route_losses``, ``forward_losses``, ``TinyTextEncoder``, ``TinyUNet``
* ``gradroute.cli.workloads.build``, ``gradroute.cli.workloads.Workload``
* ``gradroute.cli.workloads.sd15.sd15_configs``, ``gradroute.cli.workloads.sd15.unet_cut_points``
* ``gradroute.cli.bench.runner.Runner``, ``gradroute.cli.bench.measure.measure``
* ``gradroute.cli.bench.step_report.parse_targets``
* ``gradroute.cli.demo.command.run``

Example:
    >>> import torch
    >>> from gradroute.cli.data import make_batch
    >>> from gradroute.cli.models import forward_losses, make_models
    >>> tenc, unet = make_models(seed=0, width=8)
    >>> loss_tenc, loss_unet = forward_losses(tenc, unet, make_batch(2, torch.Generator().manual_seed(0)))
    >>> loss_tenc.shape, loss_unet.shape
    (torch.Size([]), torch.Size([]))
"""
