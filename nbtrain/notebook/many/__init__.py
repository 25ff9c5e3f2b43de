"""Many runs on one slot machinery: sweeps (Optuna) and map."""
