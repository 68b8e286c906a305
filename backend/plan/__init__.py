"""The offload planner: budgets, expert placement, speed estimates, llama.cpp settings (SIZING.md)."""

from backend.plan.make import make
from backend.plan.plan import DevicePlan, Plan
from backend.plan.stats import ExpertStats
from backend.plan.workload import Workload

__all__ = ["DevicePlan", "ExpertStats", "Plan", "Workload", "make"]
