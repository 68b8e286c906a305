"""The offload planner: budgets, expert placement, speed estimates, llama.cpp settings (docs/sizing.md)."""

from hybridmoe.backend.plan.make import make
from hybridmoe.backend.plan.plan import DevicePlan, Plan
from hybridmoe.backend.plan.stats import ExpertStats
from hybridmoe.backend.plan.workload import Workload

__all__ = ["DevicePlan", "ExpertStats", "Plan", "Workload", "make"]
