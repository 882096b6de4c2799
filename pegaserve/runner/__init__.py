"""The model runner: a step's tensors, the forward pass, sampling and scoring."""
