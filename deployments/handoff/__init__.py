"""The KV handoff, prefill -> decode, in one place.

- `protocol`: the lease the ingress carries from prefill to decode, and the control messages.
- `sender`: the prefill side. It serves fetches from the engine's parked requests (the engine
  owns the leases: their blocks, their expiry), reading the blocks straight from the KV cache the
  engine process shares with its replica.
- `receiver`: the decode side. It claims a prompt's blocks (only those its own prefix cache lacks)
  and writes them into the blocks its engine reserved: copied straight out of the prefill engine's
  cache in shared memory when both replicas share a node (`shm`), or received.
- `push`: on gloo, prefill sends a prompt's blocks as it leases them, before decode asks, when it
  is paired with one decode replica; decode copies them out of what landed.
- `transports`: how the bytes move otherwise: gloo or nccl pair channels (one per prefill/decode
  pair, in an order both sides agree on), or the Ray object store.
"""
