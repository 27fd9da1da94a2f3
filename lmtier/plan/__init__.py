"""``lmtier plan``: a fleet's traffic replayed through lmtier's own policies, to size every
tier before it is deployed.

    traces   requests: the Mooncake format, lmtier's request log, synthetic workloads
    fleet    the fleet a plan describes (YAML): instances, router, tiers, costs
    sim      the replay: hit ratios per tier and peer, bytes per tier and link, TTFT
    tiers    the simulated tiers, in lmtier's eviction order or another policy's
    policies eviction policies beyond LRU, for a plan to try
    report   sweeps over a setting, the smallest that meets a goal, tables and a plot
"""

from lmtier.plan.fleet import Fleet
from lmtier.plan.sim import simulate

__all__ = ["Fleet", "simulate"]
