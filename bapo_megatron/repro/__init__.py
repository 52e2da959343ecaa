"""The reproduction kit: run plots, the loss demo and the staleness sweep."""
