"""Tests of serve."""
