"""Real serving workloads shipped as packages."""
