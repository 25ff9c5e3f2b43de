"""Live ranks: one pool serving many commands until closed."""
