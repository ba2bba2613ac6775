"""Slot layouts: the byte-exact slot and expert-slot layouts, tensor/expert-parallel shards, and
the plan from audited adapters to layouts. Imports adapters/ and earlier stages."""
