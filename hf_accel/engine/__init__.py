"""The fast decode path: a whole-model decode step captured in CUDA graphs, and the generate loop on it."""
