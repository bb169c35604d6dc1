"""State shared by several gateway processes and replicas (Redis): see :mod:`gateway.state.shared`."""

from gateway.state.errors import StateUnavailable
from gateway.state.shared import Admitted, Budget, SharedState, Slotted

__all__ = ["Admitted", "Budget", "SharedState", "Slotted", "StateUnavailable"]
