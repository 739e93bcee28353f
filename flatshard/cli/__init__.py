"""The `flatshard` command line: train, sample, plan, inspect, convert."""
