"""Scorers that need packages the graph's environment lacks: built by the `external` scorer kind
inside a scorer replica whose runtime_env installs them (test_rewards_isolated.py)."""
