"""``gradroute demo``: a text encoder and a conditional UNet trained from one forward, each on its own loss.

``command`` runs it; ``check`` compares the step-0 gradients with independent forwards; ``plot`` draws
demo.png; ``distributed`` runs it under torchrun. The models and data: ``gradroute.cli.models``,
``gradroute.cli.data``, ``gradroute.cli.noise``.
"""
