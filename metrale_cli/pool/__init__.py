"""The pool: one region type, the slot manager (state with no bytes), tensor reading and slot
fills, and `LoraPool`. Imports layout/ and earlier stages."""
