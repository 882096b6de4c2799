"""Direct connections between replicas, without Ray.

- `channel`: authenticated, length-prefixed frames over TCP (`Listener`, `connect`, `Address`).
- `tokens`: an engine replica's per-step token batches to the ingress replicas (`TokenRouter` ->
  `TokenInbox`), and the ingress's aborts back.
- `node`: where a process runs (`NodeInfo`), given by the edge that knows it (deployments/: Ray).
"""
