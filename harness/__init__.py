"""What is measured and shown: runs, samplers, results, reports, plans, simulation and the CLI."""
