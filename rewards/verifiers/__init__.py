"""Rule-based verifiers for the synthetic datasets (image: shapes; av: clips). Import submodules directly."""
