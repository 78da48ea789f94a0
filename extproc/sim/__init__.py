"""Simulation: a simulated GPU inference backend and the timing model it shares with the offline simulator."""
