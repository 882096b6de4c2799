"""The engine's CPU kernels (csrc/) and the paths that run them: the LM head, vocabulary passes."""
