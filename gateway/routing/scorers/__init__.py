from gateway.routing.plugins import SCORERS
from gateway.routing.scorers.engine_shape import EngineShapeScorer
from gateway.routing.scorers.least_load import LeastLoadScorer
from gateway.routing.scorers.precise_prefix import PrecisePrefixScorer
from gateway.routing.scorers.prefix_affinity import PrefixAffinityScorer
from gateway.routing.scorers.session import SessionScorer

SCORERS["least-load"] = LeastLoadScorer
SCORERS["prefix"] = PrefixAffinityScorer
SCORERS["precise-prefix"] = PrecisePrefixScorer
SCORERS["session"] = SessionScorer
SCORERS["engine-shape"] = EngineShapeScorer

__all__ = ["EngineShapeScorer", "LeastLoadScorer", "PrecisePrefixScorer", "PrefixAffinityScorer", "SessionScorer"]
