"""A plug-in trainer: local SGD with a learning rate that decays linearly within each client's steps, to a floor
of its own setting."""
