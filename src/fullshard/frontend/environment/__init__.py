"""Names that describe the environment a script runs in: Accelerate's enums, version checks, pretty names."""
