"""Locust load tests that check every answer against docs/contract.md (`make loadtest`)."""
