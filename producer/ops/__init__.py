"""Watching a run: status, metrics, the dashboard."""
