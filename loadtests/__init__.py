"""Locust load tests that check every answer against docs/CONTRACT.md (`make loadtest`)."""
