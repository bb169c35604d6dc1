"""One module per engine: its :class:`~gateway.engines.spec.EngineSpec` (the facts, as data) and its adapter
(the code that reads its signals). The registry (:mod:`gateway.engines.registry`) lists them; adding an
engine is a new module plus one line there (and its emulator under ``gateway/sim/engines``).

This package's ``__init__`` imports nothing, so ``gateway.engines.spec`` can be read without loading the
adapters and their HTTP client.
"""
