"""The base model: its config (`ModelConfig`, presets, `--model` resolution) and the eight pool
modules with where each applies and their dims. Imports files/ and the leaves."""
