"""PEFT adapters: config and keys, target patterns, findings, the per-pair checks, the audit,
routed-expert and overlay scans, and synthetic adapters. Imports model/ and earlier stages."""
