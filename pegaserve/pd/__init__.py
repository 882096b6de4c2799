"""The KV handoff, prefill -> decode, in one place, without Ray.

- `protocol`: the lease the ingress carries from prefill to decode, and the control messages.
- `sender`: the prefill side. It serves fetches from the engine's parked requests (the engine
  owns the leases: their blocks, their expiry), reading the blocks straight from the KV cache the
  engine process shares with its replica.
- `receiver`: the decode side. It claims a prompt's blocks (only those its own prefix cache lacks)
  and writes them into the blocks its engine reserved, by the lease's transport.
- `transports`: how the bytes move — a `KvTransport` per way, with a sender half and a receiver
  half, chosen by name from a registry (`transports.registry`); the CPU ones are here, those that
  need Ray register from deployments/transports/.
- `pair_channel`: a pair channel's protocol (one per prefill/decode pair, in an order both sides
  agree on), for the transports whose bytes travel on one.
- `push`: on pairs that carry pushes, prefill sends a prompt's blocks as it leases them, before
  decode asks, when it is paired with one decode replica; decode copies them out of what landed.

What only the edge knows — this node's id and address (`pegaserve.net.node.NodeInfo`) — is given.
"""
