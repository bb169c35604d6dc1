from gateway.routing.plugins import SCORERS
from gateway.routing.scorers.least_load import LeastLoadScorer

SCORERS["least-load"] = LeastLoadScorer

__all__ = ["LeastLoadScorer"]
