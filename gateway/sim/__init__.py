"""Engine emulators: fake llama.cpp, vLLM, SGLang and TabbyAPI servers that answer like the real ones.

Imports nothing from the rest of ``gateway`` but the constraint parsers it samples from
(``gateway.structured.syntax``, pure standard library). See :class:`SimSpec`, :class:`SimServer`,
:class:`Fleet`, :class:`FleetThread`, :func:`default_fleet_specs` and :func:`agent_fleet_specs`;
``python -m gateway.sim`` runs them.
"""

from gateway.sim.fleet import Fleet, FleetThread, agent_fleet_specs, default_fleet_specs
from gateway.sim.server import SimServer
from gateway.sim.spec import SimSpec

__all__ = ["Fleet", "FleetThread", "SimServer", "SimSpec", "agent_fleet_specs", "default_fleet_specs"]
