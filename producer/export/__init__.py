"""Exports for trainers: rows, files, manifests."""
