"""The reduced model at run time: the shared reducing loop (loop), its state (state), the dense variant (dense), and
the compiled path: regions, the compile entry (compile), torch.compile's hand-off (handoff), CUDA graphs (graphs)."""
