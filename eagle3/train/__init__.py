"""The train stage's library: TTT attention, target head, loss, data, loop and metrics."""
