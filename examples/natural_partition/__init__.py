"""A LEAF-style natural partition: each writer in the data is one logical client."""
