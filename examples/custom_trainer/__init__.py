"""A plug-in trainer: local SGD with a learning rate that decays to zero within each client's steps."""
