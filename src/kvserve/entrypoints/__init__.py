"""Entry points of the command line that are not services."""
