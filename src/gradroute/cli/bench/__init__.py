"""``gradroute bench``: ways of routing two losses from one forward, side by side on one workload.

``command`` runs it; ``runner`` holds a workload with its router and precision; ``strategies`` are the ways of
routing (see its docstring); ``measure`` checks each against independent forwards and times them interleaved;
``memory`` measures peak memory; ``report`` and ``plot`` present the results. ``--step`` compares whole
training iterations instead: ``loops`` (the router's loop and the hand-written one), ``step`` (runs and measures
them), ``step_report`` (presents them).
"""
