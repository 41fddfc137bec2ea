"""Plug-ins that run HARTS inside the trainers users already run (TRL; verl and AReaL).

Each plug-in trains the framework's own Hugging Face model in place
(:func:`harts.models.share_hf`); :mod:`harts.integrations.engine` holds what they share:
sharing the model, one compiled plan per batch, log-probs mapped back to the framework's
layout. The framework modules import their framework; this package and the engine do not.
"""

from harts.integrations.engine import EngineOutput, HartsEngine, IntegrationError, PlanCache, plan_key

__all__ = ["EngineOutput", "HartsEngine", "IntegrationError", "PlanCache", "plan_key"]
