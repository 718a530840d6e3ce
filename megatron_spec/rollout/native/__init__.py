"""The embedded native rollout engine (pure PyTorch, its own process, runs on CPU)."""
