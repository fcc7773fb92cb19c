"""A plug-in strategy with its own setting (strategy.kwargs) and declared capabilities."""
