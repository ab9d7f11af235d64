"""Tensor operations below the methods: attention with the log-size bias (attention), rotary positions (rope),
bipartite matching (matching) and the dense variant's group mean and unmerge (dense_merge, re-exported here)."""
from .dense_merge import group_mean, unmerge, unmerge_add

__all__ = ["group_mean", "unmerge", "unmerge_add"]
