from gateway.routing.pickers.consistent_hash import ConsistentHashPicker
from gateway.routing.pickers.max_score import MaxScorePicker
from gateway.routing.pickers.round_robin import RoundRobinPicker
from gateway.routing.plugins import PICKERS

PICKERS["max-score"] = MaxScorePicker
PICKERS["round-robin"] = RoundRobinPicker
PICKERS["consistent-hash"] = ConsistentHashPicker

__all__ = ["ConsistentHashPicker", "MaxScorePicker", "RoundRobinPicker"]
