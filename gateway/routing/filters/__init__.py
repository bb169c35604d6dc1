from gateway.routing.filters.healthy import HealthyFilter
from gateway.routing.filters.serves_model import ServesModelFilter
from gateway.routing.plugins import FILTERS

FILTERS["serves-model"] = ServesModelFilter
FILTERS["healthy"] = HealthyFilter

__all__ = ["HealthyFilter", "ServesModelFilter"]
