"""The planner: scale the prefill and decode pools separately.

OBSERVE (`observation`) -> PREDICT (`predict`) -> PROPOSE (`policy`: SLA or load)
-> CONSTRAIN (`constrain`) -> EXECUTE (a connector), one tick per interval, through
the pure core in `core`. See docs/architecture.md, "Planner".
"""

from planner.capacity import CapacityModel, StepCapacity
from planner.constrain import Decision, Limits, PoolLimits
from planner.core import Planner, TickResult
from planner.observation import POOLS, Forecast, Observation
from planner.policy import Band, LoadPolicy, Proposal, SlaPolicy
from planner.predict import PREDICTORS, make_predictor
from planner.scrape import Snapshot, observe

__all__ = [
    "POOLS",
    "PREDICTORS",
    "Band",
    "CapacityModel",
    "Decision",
    "Forecast",
    "Limits",
    "LoadPolicy",
    "Observation",
    "Planner",
    "PoolLimits",
    "Proposal",
    "SlaPolicy",
    "Snapshot",
    "StepCapacity",
    "TickResult",
    "make_predictor",
    "observe",
]
