"""eagletools: train, convert and validate EAGLE-3 draft heads."""

__version__ = "0.1.0"
