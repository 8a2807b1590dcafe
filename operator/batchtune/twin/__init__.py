"""The twin: a physically grounded simulator of vLLM serving on a GPU (memory, scheduler, step time)."""
