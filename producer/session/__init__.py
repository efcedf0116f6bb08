"""The attached session: attach, the loop that enqueues and collects, its state and report."""
