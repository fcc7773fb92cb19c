"""Fault injection under mpiexec: hangs, exits, kills, corruption, bad input (see README, Reliability)."""
