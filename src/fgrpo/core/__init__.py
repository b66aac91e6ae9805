"""The functional core: pure torch, tensor in / tensor out, fp32 math, randomness passed in.

Nothing here imports from the shell (models, rollout, rewards, train)."""
