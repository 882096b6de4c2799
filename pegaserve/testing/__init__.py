"""Test doubles and contract checks, kept out of the product modules.

Nothing in `pegaserve.engine`, `pegaserve.api` or `deployments` imports this package except through
the one documented hook (`pegaserve.testing.hook`), which the Serve replicas consult so the P/D
contract tests can run a scripted model behind the real engine.
"""
