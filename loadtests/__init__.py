"""Locust load tests that check every answer against CONTRACT.md (`make loadtest`)."""
