"""The Ray edge: the only package that imports Ray. Ingress, prefill, decode, the ledger actor,
the KV transports and the app builder."""
