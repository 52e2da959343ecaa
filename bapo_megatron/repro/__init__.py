"""The reproduction kit: evaluation, run plots, the loss demo and the staleness sweep."""
