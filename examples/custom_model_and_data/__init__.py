"""A plug-in model sized by mpifl from the data, and a plug-in dataset."""
