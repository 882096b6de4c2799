"""The KV transports: `base` (what one is: a sender half and a receiver half), `registry` (by
name), and the CPU ones, `shm` and `gloo` (with `native`, its C++ side, csrc/gloo_pair.cpp)."""
