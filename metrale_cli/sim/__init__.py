"""Workloads and the slot-cache simulator that drives the pool's own slot manager. Imports layout/
and pool/ and earlier stages."""
