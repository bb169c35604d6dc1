from gateway.routing.filters.below_max_concurrency import BelowMaxConcurrencyFilter
from gateway.routing.filters.fits_context import FitsContextFilter
from gateway.routing.filters.healthy import HealthyFilter
from gateway.routing.filters.serves_model import ServesModelFilter
from gateway.routing.filters.structured_output import StructuredOutputFilter
from gateway.routing.plugins import FILTERS

FILTERS["serves-model"] = ServesModelFilter
FILTERS["structured-output"] = StructuredOutputFilter
FILTERS["healthy"] = HealthyFilter
FILTERS["fits-context"] = FitsContextFilter
FILTERS["below-max-concurrency"] = BelowMaxConcurrencyFilter

__all__ = ["BelowMaxConcurrencyFilter", "FitsContextFilter", "HealthyFilter", "ServesModelFilter",
           "StructuredOutputFilter"]
