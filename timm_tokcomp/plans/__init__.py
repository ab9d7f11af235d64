"""Reduction plans: what one block's reduction does. Each kind lives in its own file with its execution
(`plan.apply(x, size, source)`) and where its outputs' rotary positions come from (`plan.at_destinations(coords)`);
a method (methods/) decides a plan, the plan carries itself out. A new kind of plan is a new file here."""
from .base import GridCells, Plan, Reduced, gather_tokens, split_tokens
from .cluster import ClusterPlan
from .grid import GridMergePlan
from .group import GroupPlan
from .keep_merge import KeepMergePlan
from .merge import MergePlan
from .prune import PrunePlan
from .resample import ResamplePlan
from .soft import SoftPlan
from .truncate import TruncatePlan

__all__ = ["GridCells", "Plan", "Reduced", "gather_tokens", "split_tokens", "ClusterPlan", "GridMergePlan", "GroupPlan",
           "KeepMergePlan", "MergePlan", "PrunePlan", "ResamplePlan", "SoftPlan", "TruncatePlan"]
