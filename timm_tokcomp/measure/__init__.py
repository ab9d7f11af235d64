"""Measuring: MACs and ops counted from the run (counting, re-exported here), timing, precision, the device table
of measured defaults, the statistics of paired comparisons (stats) and the agreement evaluation (agreement)."""
from .counting import (ATTENTION_LAYOUTS, FUSED_MHA, HOST_SYNC_OPS, AttentionCountError, MacCounter, OpCounter,
                       attention_macs, count_macs, forward_counting, kernel_launch, mha_macs)

__all__ = ["ATTENTION_LAYOUTS", "FUSED_MHA", "HOST_SYNC_OPS", "AttentionCountError", "MacCounter", "OpCounter",
           "attention_macs", "count_macs", "forward_counting", "kernel_launch", "mha_macs"]
